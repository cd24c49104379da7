"""agents.spec / agents.registry: YAML agents, validation errors, create/update/delete rules, authorize."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agents.registry import (
    DEFAULT_AGENTS_DIR,
    AgentConfigError,
    AgentConflictError,
    AgentRegistry,
    ReadOnlyAgentError,
    UnknownAgentError,
    authorize,
    load_agent_file,
    load_agent_files,
)
from agents.spec import AgentSpec
from agents.store import MemoryStore

TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------------
# the shipped configs
# --------------------------------------------------------------------------------------------------


def test_shipped_agents_load():
    specs = load_agent_files(DEFAULT_AGENTS_DIR)
    assert {"assistant", "weather", "extractor"} <= specs.keys()
    assistant = specs["assistant"]
    assert assistant.system_prompt and assistant.tools is None and assistant.response_format is None
    weather = specs["weather"]
    assert weather.tool_choice == "auto"
    (tool,) = weather.tools
    assert tool["function"]["name"] == "get_weather"
    assert tool["function"]["parameters"]["required"] == ["city"]
    extractor = specs["extractor"]
    body = extractor.response_format["json_schema"]
    assert extractor.response_format["type"] == "json_schema" and body["strict"] is True
    assert set(body["schema"]["properties"]) == {"name", "email", "age"}
    assert all(s.system_prompt.strip() for s in specs.values())


def test_registry_serves_file_agents():
    async def main():
        registry = AgentRegistry(MemoryStore())
        names = [s.name for s in await registry.list()]
        assert names == sorted(names) and {"assistant", "weather", "extractor"} <= set(names)
        assert (await registry.get("weather")).tools is not None
        assert registry.is_file_agent("assistant")
        with pytest.raises(UnknownAgentError, match="unknown agent 'nope'"):
            await registry.get("nope")
        with pytest.raises(KeyError):  # UnknownAgentError is also a KeyError
            await registry.get("Not A Slug")

    asyncio.run(main())


# --------------------------------------------------------------------------------------------------
# YAML loading errors
# --------------------------------------------------------------------------------------------------


def test_name_defaults_to_file_stem(tmp_path):
    spec = load_agent_file(write(tmp_path, "helper.yaml", "system_prompt: Be kind.\n"))
    assert spec.name == "helper" and spec.system_prompt == "Be kind."


@pytest.mark.parametrize(
    ("filename", "text", "message"),
    [
        ("a.yaml", "system_prompt: [unclosed\n", "cannot read YAML"),
        ("a.yaml", "- just\n- a list\n", "expected a mapping"),
        ("a.yaml", "name: b\n", "must match the file name"),
        ("Bad_Name.yaml", "description: x\n", "name"),
        ("a.yaml", "defaults:\n  temprature: 0.5\n", "temprature"),
        ("a.yaml", "defaults:\n  temperature: 3\n", "temperature"),
        ("a.yaml", "colour: blue\n", "colour"),
        ("a.yaml", "priority: 0\n", "priority"),
        ("a.yaml", "context_limit: 0\n", "context_limit"),
        ("a.yaml", "tool_choice: required\n", "tool_choice 'required' without tools"),
        ("a.yaml", "response_format: {type: xml}\n", "response_format.type must be one of"),
        ("a.yaml", "tools: [{type: function, function: {name: 'bad name'}}]\n", "invalid function name"),
    ],
)
def test_bad_files_fail_with_file_and_field(tmp_path, filename, text, message):
    path = write(tmp_path, filename, text)
    with pytest.raises(AgentConfigError) as info:
        load_agent_file(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def test_duplicate_names_across_files_are_refused(tmp_path):
    write(tmp_path, "dup.yaml", "description: one\n")
    write(tmp_path, "dup.yml", "description: two\n")
    with pytest.raises(AgentConfigError, match="defined twice"):
        load_agent_files(tmp_path)


def test_missing_directory_means_no_file_agents(tmp_path):
    assert load_agent_files(tmp_path / "absent") == {}


# --------------------------------------------------------------------------------------------------
# AgentSpec validation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "assistant", "my-agent_2", "0x", "a" * 64])
def test_valid_names(name):
    assert AgentSpec(name=name).name == name
    assert AgentSpec.is_valid_name(name)


@pytest.mark.parametrize("name", ["", "A", "-a", "_a", "a b", "a.b", "a/b", "é", "a" * 65])
def test_invalid_names(name):
    with pytest.raises(ValidationError, match="name"):
        AgentSpec(name=name)
    assert not AgentSpec.is_valid_name(name)


def test_spec_defaults_and_normalisation():
    spec = AgentSpec(name="x", defaults={"stop": "###", "top_k": 0})
    assert spec.defaults.stop == ["###"] and spec.defaults.top_k == 0
    assert spec.priority == 1 and spec.api_keys == [] and spec.tool_choice == "auto"
    assert spec.context_limit is None and spec.tools is None
    assert AgentSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"defaults": {"top_p": 0}}, "top_p"),
        ({"defaults": {"max_tokens": 0}}, "max_tokens"),
        ({"defaults": {"stop": [""]}}, "stop strings must be non-empty"),
        ({"api_keys": ["has space"]}, "api_keys"),
        ({"api_keys": [""]}, "api_keys"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "takes no other fields"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "schema is required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "name must match"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": 3}}}, "schema"),
        ({"tools": []}, "non-empty list"),
        ({"tools": [{"name": "f"}]}, "tools[0]"),
        ({"tools": [TOOL, TOOL]}, "declared twice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "unknown function"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_spec_validation_errors_name_the_problem(fields, message):
    with pytest.raises(ValidationError) as info:
        AgentSpec(name="x", **fields)
    assert message in str(info.value)


def test_spec_accepts_tools_and_structured_output():
    spec = AgentSpec(
        name="x",
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        response_format={"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {}}},
    )
    assert spec.tool_choice["function"]["name"] == "lookup"


def test_patched_and_public_dict():
    spec = AgentSpec(name="x", description="old", api_keys=["secret-key"])
    new = spec.patched({"description": "new", "defaults": {"temperature": 0.1}})
    assert new.description == "new" and new.defaults.temperature == 0.1 and new.api_keys == ["secret-key"]
    with pytest.raises(ValidationError):
        spec.patched({"priority": 0})
    with pytest.raises(ValueError, match="cannot be changed"):
        spec.patched({"name": "y"})
    public = new.public_dict()
    assert "api_keys" not in public and "secret-key" not in str(public) and public["auth_required"] is True


# --------------------------------------------------------------------------------------------------
# create / update / delete rules
# --------------------------------------------------------------------------------------------------


def make_registry(tmp_path: Path, **kw: Any) -> AgentRegistry:
    write(tmp_path, "base.yaml", "system_prompt: I am defined by a file.\n")
    return AgentRegistry(MemoryStore(), tmp_path, **kw)


def test_create_update_delete_rules(tmp_path):
    async def main():
        registry = make_registry(tmp_path)
        created = await registry.create(AgentSpec(name="dyn", description="v1"))
        assert (await registry.get("dyn")) == created
        assert [s.name for s in await registry.list()] == ["base", "dyn"]

        with pytest.raises(AgentConflictError, match="already exists"):
            await registry.create(AgentSpec(name="base"))  # a file agent's name
        with pytest.raises(AgentConflictError):
            await registry.create(AgentSpec(name="dyn"))  # a store agent's name

        await registry.update(AgentSpec(name="dyn", description="v2"))
        assert (await registry.get("dyn")).description == "v2"
        patched = await registry.patch("dyn", {"priority": 5})
        assert patched.priority == 5 and patched.description == "v2"
        with pytest.raises(UnknownAgentError):
            await registry.update(AgentSpec(name="ghost"))
        with pytest.raises(UnknownAgentError):
            await registry.patch("ghost", {"priority": 2})

        for attempt in (
            registry.update(AgentSpec(name="base", description="hijack")),
            registry.patch("base", {"description": "hijack"}),
            registry.delete("base"),
        ):
            with pytest.raises(ReadOnlyAgentError, match="config file"):
                await attempt
        assert (await registry.get("base")).system_prompt == "I am defined by a file."

        await registry.store.append_turn("dyn", "s1", [{"role": "user", "content": "hi"}])
        await registry.delete("dyn")
        with pytest.raises(UnknownAgentError):
            await registry.get("dyn")
        with pytest.raises(UnknownAgentError):
            await registry.delete("dyn")
        assert await registry.store.get_session("dyn", "s1") is None  # its sessions went with it
        assert [s.name for s in await registry.list()] == ["base"]

    asyncio.run(main())


def test_get_sees_other_servers_changes_after_cache_ttl(tmp_path):
    async def main():
        store = MemoryStore()  # stands in for a shared Redis
        here = AgentRegistry(store, None, cache_ttl=0.2)
        there = AgentRegistry(store, None, cache_ttl=0.2)
        await here.create(AgentSpec(name="dyn", description="v1"))
        assert (await there.get("dyn")).description == "v1"  # unknown names are never cached
        await here.update(AgentSpec(name="dyn", description="v2"))
        assert (await here.get("dyn")).description == "v2"  # own writes: at once
        assert (await there.get("dyn")).description == "v1"  # another server: cached ...
        await asyncio.sleep(0.25)
        assert (await there.get("dyn")).description == "v2"  # ... until the cache entry expires
        await here.delete("dyn")
        await asyncio.sleep(0.25)
        with pytest.raises(UnknownAgentError):
            await there.get("dyn")

    asyncio.run(main())


def test_extra_agents_are_read_only(tmp_path):
    async def main():
        registry = AgentRegistry(MemoryStore(), None, extra_agents=[AgentSpec(name="embedded")])
        assert registry.is_file_agent("embedded")
        with pytest.raises(ReadOnlyAgentError):
            await registry.delete("embedded")

    asyncio.run(main())
    with pytest.raises(AgentConfigError, match="defined twice"):
        make_registry(tmp_path, extra_agents=[AgentSpec(name="base")])


# --------------------------------------------------------------------------------------------------
# authorize
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "given", "auth_enabled", "allowed"),
    [
        ([], None, False, True),  # open agent, auth off
        ([], "anything", False, True),
        ([], None, True, False),  # auth on: an agent without keys is closed
        ([], "anything", True, False),
        (["k1", "k2"], "k2", False, True),  # an agent's keys apply whether or not auth is on
        (["k1", "k2"], "k2", True, True),
        (["k1", "k2"], "k3", False, False),
        (["k1", "k2"], None, False, False),
        (["k1", "k2"], "", True, False),
        (["k1"], "k1 ", True, False),
        (["k1"], "K1", True, False),
    ],
)
def test_authorize(keys, given, auth_enabled, allowed):
    agent = AgentSpec(name="x", api_keys=keys)
    assert authorize(agent, given, auth_enabled) is allowed
    assert AgentRegistry.authorize(agent, given, auth_enabled) is allowed


def test_agents_package_imports_neither_fastapi_nor_jax():
    code = (
        "import sys, agents.chat_template, agents.registry, agents.store.redis_store, agents.store, agents.errors, "
        "agents.chat_params, agents.history, agents.store.lease; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'jax', 'jaxlib'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == "[]"
