"""`AgentRegistry`: the agents a server serves, from YAML files and from the store.

Rules:

* File agents (``configs/agents/*.yaml``, one agent per file, loaded once at start-up) are read-only
  base definitions: the admin API can neither update nor delete them (`ReadOnlyAgentError`).
* Admin-created agents live in the store, so every server sharing one store (Redis) sees them.
* A name is unique across both: creating an agent whose name exists anywhere fails
  (`AgentConflictError`); nothing shadows anything.
* `get` consults the store (through a short per-process cache, ``cache_ttl`` seconds, so a change made
  by another server is seen within that time; this server's own writes are seen at once).

Suggested HTTP mapping: UnknownAgentError 404, AgentConflictError 409, ReadOnlyAgentError 403,
pydantic ValidationError 422, AgentConfigError is a start-up failure.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from agents.spec import AgentSpec
from agents.store import Store

__all__ = [
    "DEFAULT_AGENTS_DIR",
    "AgentConfigError",
    "AgentConflictError",
    "AgentError",
    "AgentRegistry",
    "ReadOnlyAgentError",
    "UnknownAgentError",
    "authorize",
    "load_agent_file",
    "load_agent_files",
]

DEFAULT_AGENTS_DIR = Path(__file__).resolve().parent.parent / "configs" / "agents"


class AgentError(Exception):
    """Base of the registry's errors."""


class UnknownAgentError(AgentError, KeyError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(name)

    def __str__(self) -> str:
        return f"unknown agent {self.name!r}"


class AgentConflictError(AgentError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"an agent named {name!r} already exists")


class ReadOnlyAgentError(AgentError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"agent {name!r} is defined by a config file and cannot be changed through the API")


class AgentConfigError(AgentError, ValueError):
    """An agent YAML file that cannot be loaded; the message names the file and the field."""


def load_agent_file(path: Path) -> AgentSpec:
    """One agent from a YAML mapping; ``name`` defaults to the file's stem and must match it if given."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise AgentConfigError(f"{path}: cannot read YAML: {e}") from e
    if not isinstance(data, dict):
        raise AgentConfigError(f"{path}: expected a mapping of agent fields, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    if data["name"] != path.stem:
        raise AgentConfigError(f"{path}: name {data['name']!r} must match the file name {path.stem!r}")
    if isinstance(data.get("adapter"), str) and data["adapter"]:  # trusted like the file: relative to it
        data["adapter"] = str(path.parent / Path(data["adapter"]).expanduser())
    try:
        return AgentSpec.model_validate(data)
    except ValidationError as e:
        raise AgentConfigError(f"{path}: invalid agent: {e}") from e


def load_agent_files(directory: Path) -> dict[str, AgentSpec]:
    """Every ``*.yaml`` / ``*.yml`` in ``directory`` (none if it does not exist), by name."""
    if not directory.is_dir():
        return {}
    specs: dict[str, AgentSpec] = {}
    for path in sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")]):
        spec = load_agent_file(path)
        if spec.name in specs:
            raise AgentConfigError(f"{path}: agent {spec.name!r} is defined twice")
        specs[spec.name] = spec
    return specs


def authorize(agent: AgentSpec, key: str | None, auth_enabled: bool) -> bool:
    """Whether ``key`` may use ``agent``.

    An agent with api_keys always requires one of them. An agent without keys is open only while auth
    is off; with auth on it is closed (the server may still accept its own admin key separately).
    Keys are compared in constant time, and all of them are checked, so timing reveals nothing.
    """
    if not agent.api_keys:
        return not auth_enabled
    if not key:
        return False
    given = key.encode()
    matched = False
    for candidate in agent.api_keys:
        matched |= hmac.compare_digest(given, candidate.encode())
    return matched


class AgentRegistry:
    """File agents plus store agents; see the module docstring for the rules."""

    def __init__(
        self,
        store: Store,
        agents_dir: Path | None = DEFAULT_AGENTS_DIR,
        *,
        extra_agents: Iterable[AgentSpec] = (),
        cache_ttl: float = 1.0,
    ) -> None:
        self.store = store
        self._files = load_agent_files(Path(agents_dir)) if agents_dir is not None else {}
        for spec in extra_agents:  # programmatic read-only agents (tests, embedding)
            if spec.name in self._files:
                raise AgentConfigError(f"agent {spec.name!r} is defined twice")
            self._files[spec.name] = spec
        self._cache_ttl = cache_ttl
        self._cache: dict[str, tuple[float, AgentSpec]] = {}

    def is_file_agent(self, name: str) -> bool:
        return name in self._files

    @property
    def file_agents(self) -> list[AgentSpec]:
        return [self._files[n] for n in sorted(self._files)]

    async def get(self, name: str) -> AgentSpec:
        if (spec := self._files.get(name)) is not None:
            return spec
        cached = self._cache.get(name)
        if cached is not None and time.monotonic() - cached[0] < self._cache_ttl:
            return cached[1]
        spec = await self.store.get_agent(name) if AgentSpec.is_valid_name(name) else None
        if spec is None:
            self._cache.pop(name, None)
            raise UnknownAgentError(name)
        self._cache[name] = (time.monotonic(), spec)
        return spec

    async def list(self) -> list[AgentSpec]:
        """All agents, sorted by name."""
        stored = [s for s in await self.store.list_agents() if s.name not in self._files]
        return sorted([*self._files.values(), *stored], key=lambda s: s.name)

    async def create(self, spec: AgentSpec) -> AgentSpec:
        if spec.name in self._files or not await self.store.put_agent(spec, mode="create"):
            raise AgentConflictError(spec.name)
        self._cache.pop(spec.name, None)
        return spec

    async def update(self, spec: AgentSpec) -> AgentSpec:
        """Replace a store agent's whole definition (use `AgentSpec.patched` for partial changes)."""
        if spec.name in self._files:
            raise ReadOnlyAgentError(spec.name)
        self._cache.pop(spec.name, None)
        if not await self.store.put_agent(spec, mode="update"):
            raise UnknownAgentError(spec.name)
        return spec

    async def patch(self, name: str, changes: dict[str, Any]) -> AgentSpec:
        """Apply a partial change to a store agent (read, validate, replace)."""
        if name in self._files:
            raise ReadOnlyAgentError(name)
        self._cache.pop(name, None)
        return await self.update((await self.get(name)).patched(changes))

    async def delete(self, name: str) -> None:
        """Delete a store agent and its sessions."""
        if name in self._files:
            raise ReadOnlyAgentError(name)
        self._cache.pop(name, None)
        if not AgentSpec.is_valid_name(name) or not await self.store.delete_agent(name):
            raise UnknownAgentError(name)

    @staticmethod
    def authorize(agent: AgentSpec, key: str | None, auth_enabled: bool) -> bool:
        return authorize(agent, key, auth_enabled)
