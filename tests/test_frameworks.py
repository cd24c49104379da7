"""Agent frameworks, unmodified, against a live server on the real default model (W8A8, int8 KV, as served):
pydantic-ai, LangChain's ChatOpenAI, the Anthropic SDK and the OpenAI Agents SDK (on its default Responses
model and on its Chat Completions model). Greedy decoding, so each run takes the same path.

The OpenAI Agents SDK runs in a virtualenv of its own under .cache/venvs (its top-level package `agents`
is also ours); the others are test extras of this project.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel
from test_server_helpers import LiveServer, server_config

from server.app import create_app

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
AGENTS_SDK = ("openai-agents==0.24.0", "openai==3.57.0")


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    sunny: bool


@pytest.fixture(scope="module")
def server(compile_cache):
    config = server_config(model__slots=4, model__max_len=2048, model__chunk_sizes=[32, 128],
                           limits__max_tokens=256, limits__default_max_tokens=64, limits__max_body_bytes=1_000_000)
    srv = LiveServer(create_app(config)).start(timeout=900)  # the real model, loaded as `slotserve serve` does
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"{server.url}/agents/assistant/v1"


def framework_venv(name: str, requirements: tuple[str, ...]) -> Path:
    """A virtualenv with exactly ``requirements``, kept under .cache/venvs between runs; its python."""
    root = REPO / ".cache" / "venvs" / name
    python, marker = root / "bin" / "python", root / ".requirements"
    if marker.exists() and marker.read_text() == "\n".join(requirements):
        return python
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements], check=True, timeout=1200)
    marker.write_text("\n".join(requirements))
    return python


# ---- the OpenAI client: a cache hit at any split gives the cold run's logprobs ---------------------------


def test_completions_after_a_prefix_cut_anywhere_give_the_cold_logprobs(server):
    """The issue-29 check through HTTP on the served default (W8A8, int8 KV): a ~900-token prompt sent cold,
    and again after a prefix of it cut at an odd character (mid-word, inside a chunk) was sent first, each
    under its own cache_salt so that nothing else is shared: the reused tokens are reported and the 24
    greedy tokens come back with the same logprobs, float for float."""
    from openai import OpenAI

    from core.quality import reference_text

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    words = reference_text().split()
    prompt = " ".join(words[:700])

    def complete(text: str, salt: str, max_tokens: int = 24):
        return client.completions.create(model="assistant", prompt=text, max_tokens=max_tokens, temperature=0,
                                         logprobs=1, extra_body={"cache_salt": salt, "ignore_eos": True})

    cold = complete(prompt, "cold")
    assert cold.usage.prompt_tokens > 800
    want = (cold.choices[0].text, cold.choices[0].logprobs.token_logprobs)
    for cut in (951, 2203, 3377):
        salt = f"cut-{cut}"
        complete(prompt[:cut], salt, max_tokens=1)
        again = complete(prompt, salt)
        assert again.usage.prompt_tokens_details.cached_tokens > 0.8 * cut / len(prompt) * again.usage.prompt_tokens
        assert (again.choices[0].text, again.choices[0].logprobs.token_logprobs) == want, cut


# ---- pydantic-ai -----------------------------------------------------------------------------------


def test_pydantic_ai_typed_output_a_tool_and_a_second_turn(base_url):
    from pydantic_ai import Agent, RunContext, Tool
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("assistant", provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    settings = {"temperature": 0, "max_tokens": 64}
    typed = Agent(model, output_type=Weather, instructions="Report the weather.", model_settings=settings)
    first = typed.run_sync("Weather in Paris?")
    assert isinstance(first.output, Weather)
    second = typed.run_sync("And in Oslo?", message_history=first.all_messages())
    assert isinstance(second.output, Weather) and len(second.all_messages()) > len(first.all_messages())

    calls: list[str] = []

    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    async def until_called(ctx: RunContext, tool_def):  # offered until it has run once
        return None if calls else tool_def

    agent = Agent(model, output_type=Weather, instructions="Look the weather up with get_weather, then report it.",
                  tools=[Tool(get_weather, prepare=until_called)],
                  model_settings={**settings, "tool_choice": ["get_weather", "final_result"]})
    result = agent.run_sync("Use get_weather for Oslo.")
    assert calls and isinstance(result.output, Weather)
    returns = [p for m in result.all_messages() for p in m.parts if p.part_kind == "tool-return"]
    assert any(p.tool_name == "get_weather" and "Sunny in" in p.content for p in returns)


# ---- LangChain -------------------------------------------------------------------------------------------


def test_langchain_structured_output_named_tool_round_trip_and_stream(base_url):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="assistant", base_url=base_url, api_key="unused", temperature=0, max_tokens=64,
                     max_retries=0)
    report = llm.with_structured_output(Weather).invoke("Weather in Paris?")
    assert isinstance(report, Weather)

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return f"Sunny in {city}"

    asked = HumanMessage("What is the weather in Oslo?")
    called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([asked])
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo")
    answer = llm.bind_tools([get_weather]).invoke(
        [asked, called, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])])
    assert answer.content or answer.tool_calls
    chunks = list(llm.stream("Hello there"))
    assert len(chunks) > 1 and "".join(c.content for c in chunks) == llm.invoke("Hello there").content
    streamed = None
    for chunk in llm.bind_tools([get_weather], tool_choice="get_weather").stream([asked]):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls[0]["name"] == "get_weather"
    assert streamed.tool_calls[0]["args"]["city"] in ("Paris", "Oslo")


# ---- the Anthropic SDK ---------------------------------------------------------------------------------


def test_anthropic_sdk_message_forced_tool_use_round_trip_and_stream(server):
    import anthropic

    client = anthropic.Anthropic(base_url=f"{server.url}/agents/assistant", api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "The weather in a city.",
              "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                               "required": ["city"]}}]
    asked = {"role": "user", "content": "What is the weather in Oslo?"}
    message = client.messages.create(model="assistant", max_tokens=32, messages=[asked])
    assert message.content and message.content[0].type == "text"
    called = client.messages.create(model="assistant", max_tokens=64, messages=[asked], tools=tools,
                                    tool_choice={"type": "tool", "name": "get_weather"})
    [use] = called.content
    assert use.type == "tool_use" and use.input["city"] in ("Paris", "Oslo")
    follow = client.messages.create(model="assistant", max_tokens=32, tools=tools, messages=[
        asked, {"role": "assistant", "content": called.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}])
    assert follow.content
    with client.messages.stream(model="assistant", max_tokens=32, messages=[asked]) as stream:
        text = "".join(stream.text_stream)
    assert text == stream.get_final_message().content[0].text


# ---- the OpenAI Agents SDK -----------------------------------------------------------------------------


def test_openai_agents_sdk_on_responses_and_on_chat_completions(server, base_url, tmp_path):
    python = framework_venv("openai-agents-0.24.0", AGENTS_SDK)
    script = Path(__file__).parent / "frameworks" / "agents_sdk.py"
    run = subprocess.run([str(python), str(script), base_url], capture_output=True, text=True, timeout=900,
                         cwd=tmp_path)  # outside the repository: its `agents` package is not ours
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for kind in ("responses", "chat"):
        got = results[kind]
        assert got["calls"] == ["Paris"] or got["calls"] == ["Oslo"]  # the forced call ran once
        assert got["tool_output"] == f"Sunny in {got['calls'][0]}"
        assert Weather(**got["typed"]) and Weather(**got["second"])
        # A tool and a typed output on one agent: one call, then the typed answer (no call loop to max_turns;
        # under Gemma's turn tokens the base model called the tool again until MaxTurnsExceeded).
        assert got["tool_then_typed"]["typed"] is not None, got["tool_then_typed"]
        assert len(got["tool_then_typed"]["calls"]) == 1 and Weather(**got["tool_then_typed"]["typed"])
    chained = httpx.get(f"{base_url}/responses/{results['responses']['second_id']}").json()
    assert chained["previous_response_id"] == results["responses"]["first_id"]
    assert chained["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the first turn's prefix was reused
