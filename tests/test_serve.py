"""``jax-paged-attn serve``: the OpenAI-compatible server, started for real on the loopback.

One server process (module-scoped, `server`) serves a tiny random-weight Llama written
by the test (tests/test_llm.py's checkpoint, plus a chat template in
tokenizer_config.json), with small engine shapes so that its CPU warm-up is short. The
real ``openai`` client drives completions, chat, streaming, ``n`` > 1, stop strings and
logprobs, and every generation is compared with offline `LLM.generate` over the same
checkpoint (`offline`): greedy and seeded sampling give the same tokens whatever shares
the batch. Raw HTTP (urllib) sends what the client would refuse to (malformed JSON,
wrong types) and checks each 4xx in OpenAI's error shape, the server still serving
after. README's serve section runs as written against it (its curl stream, its openai
example; its install and serve commands checked against pyproject and the server's
parser). Then: 64 concurrent greedy requests, a client disconnecting mid-stream (its
blocks come back: /metrics), the front end's admission limit and engine-failure path
(in-process, over the offline `LLM`), and SIGTERM (running requests finish, then the
process exits). Only bounded waits depend on time.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import io
import json
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request

import pytest
from flax import nnx

from jax_paged_attn.engine import LLM, SamplingParams  # noqa: E402
from jax_paged_attn.models import LlamaConfig, LlamaForCausalLM, save_checkpoint  # noqa: E402
from jax_paged_attn.serve.chat_template import load_chat_template  # noqa: E402
from test_llm import CORPUS, word_tokenizer  # noqa: E402

# One pytest-xdist worker runs the module (README's `--dist loadgroup`): one server start.
pytestmark = pytest.mark.xdist_group("server")

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}my{% endif %}")
# tests/test_llm.py's small shapes (few programs to compile on a CPU), with the default
# block-table width so a sequence may reach max_model_len (the disconnect test's long one).
# The penalties' programs compile on first use (tests/test_warmup.py covers their warm-up):
# the one test that asks for penalties compiles a few programs, not every shape's.
ENGINE = dict(num_blocks=40, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, num_host_blocks=8,
              batch_buckets=(4,), token_buckets=(32,), coarse_length_bounds=True, warmup_penalties=False,
              compiler_options={"xla_backend_optimization_level": 0})
MAX_MODEL_LEN = 512  # LlamaConfig.tiny's max_position_embeddings
READY_TIMEOUT_S = 300
LONG = 480  # output tokens of a request that runs for seconds on a CPU


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_chat")
    tokenizer = word_tokenizer()
    config = LlamaConfig.tiny(vocab_size=tokenizer.get_vocab_size())
    save_checkpoint(LlamaForCausalLM(config, rngs=nnx.Rngs(1), implementation="xla"), config, directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))
    return directory, tokenizer


@pytest.fixture(scope="module")
def offline(checkpoint):
    return LLM(checkpoint[0], implementation="xla", **ENGINE)


def openai():
    """The openai client package, imported on first use: its import takes about a second of
    CPU, which only the pytest-xdist worker that runs this module (its group) spends, not
    every worker that collects it."""
    import openai

    return openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log_path: str) -> None:
        self.process, self.port, self.log_path = process, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai().OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]


def start_server(directory, log_path: str, *flags: str) -> Server:
    """``python -m jax_paged_attn.serve`` on the test checkpoint with the tests' engine
    options and ``flags``, once ``/health`` answers 200."""
    port = free_port()
    extra = {k: v for k, v in ENGINE.items() if k not in ("num_blocks", "block_size", "max_num_seqs",
                                                            "max_num_batched_tokens")}
    # The server is a process of its own, which tests/conftest.py's "no compilation cache"
    # does not reach: its engine would keep its programs under the user's ~/.cache and load
    # what an earlier run left there. It keeps them beside the checkpoint (this run's
    # temporary directory): the module's first server compiles, the later ones load.
    cache = directory.parent / f"{directory.name}_compilation_cache"
    command = [sys.executable, "-m", "jax_paged_attn.serve", str(directory), "--port", str(port),
               "--implementation", "xla", "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
               "--num-blocks", str(ENGINE["num_blocks"]), "--block-size", str(ENGINE["block_size"]),
               "--max-num-seqs", str(ENGINE["max_num_seqs"]),
               "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
               "--max-waiting-requests", "256", "--shutdown-timeout", "60", "--log-level", "warning",
               "--compilation-cache-dir", str(cache), "--engine-options", json.dumps(extra), *flags]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    served = Server(process, port, log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode} before it was ready:\n{served.log()}")
        try:
            if get(served, "/health")[0] == 200:
                return served
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server was not ready within {READY_TIMEOUT_S} s:\n{served.log()}")
        time.sleep(0.5)


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, checkpoint, tmp_path_factory):
    """The server, started for real, with its engine loop in a thread (``--engine-core
    thread``) or in an engine process of its own (``process``): every test of it runs on both."""
    served = start_server(checkpoint[0], str(tmp_path_factory.mktemp("server") / "server.log"),
                          "--engine-core", request.param)
    yield served
    if served.process.poll() is None:
        served.process.kill()
        served.process.wait(timeout=30)


# ---------------------------------------------------------------- raw HTTP
def request(server: Server, method: str, path: str, body: bytes | None = None, key: str | None = API_KEY,
            ) -> tuple[int, dict | str, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(server.url + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            status, raw, response_headers = response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as e:
        status, raw, response_headers = e.code, e.read(), dict(e.headers)
    text = raw.decode()
    try:
        return status, json.loads(text), response_headers
    except ValueError:
        return status, text, response_headers


def get(server: Server, path: str) -> tuple[int, dict | str, dict]:
    return request(server, "GET", path)


def post(server: Server, path: str, payload: dict | bytes, key: str | None = API_KEY) -> tuple[int, dict | str, dict]:
    return request(server, "POST", path, payload if isinstance(payload, bytes) else json.dumps(payload).encode(), key)


def metrics(server: Server) -> dict[str, float]:
    status, text, _ = get(server, "/metrics")
    assert status == 200
    values = {}
    for line in text.splitlines():
        match = re.match(r'^([a-z_:]+)\{model_name="[^"]*"(?:,([^}]*))?\} (\S+)$', line)
        if match:
            values[match.group(1) + (f"{{{match.group(2)}}}" if match.group(2) else "")] = float(match.group(3))
    return values


def wait_until(condition, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


# ---------------------------------------------------------------- the API
def test_models_health_and_tokenizer_routes(server, checkpoint):
    directory, tokenizer = checkpoint
    models = server.client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].root == str(directory)
    assert get(server, "/health")[:2] == (200, {"status": "ok"})
    status, body, _ = post(server, "/tokenize", {"prompt": "the cat sat"})
    assert status == 200 and body["tokens"] == tokenizer.encode("the cat sat").ids and body["count"] == 4
    assert body["max_model_len"] == MAX_MODEL_LEN
    status, body, _ = post(server, "/detokenize", {"tokens": tokenizer.encode("the cat").ids})
    assert status == 200 and body["prompt"] == "<s> the cat"


def test_completion_matches_offline_generate(server, offline):
    prompts = ["the cat sat on", "a dog ran to the red"]
    expected = offline.generate(prompts, greedy(8), use_tqdm=False)
    reply = server.client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [e.outputs[0].text for e in expected]
    assert [c.finish_reason for c in reply.choices] == ["length", "length"]
    assert reply.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert reply.usage.completion_tokens == 16 and reply.model == MODEL_NAME


def test_streamed_completion_with_n_samples_matches_offline(server, offline):
    prompt = "my name is"
    params = dict(temperature=0.9, top_p=0.9, seed=7, n=3)
    expected = offline.generate([prompt], SamplingParams(max_tokens=10, **params), use_tqdm=False)[0]
    chunks = list(server.client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, stream=True,
                                                   stream_options={"include_usage": True}, **params))
    texts, finish = ["", "", ""], [None] * 3
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            assert choice.text or choice.finish_reason  # no empty chunk
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [c.text for c in expected.outputs] and finish == ["length"] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == 3 * len(expected.prompt_token_ids)


def test_chat_uses_the_chat_template_and_streams(server, offline, checkpoint):
    directory, tokenizer = checkpoint
    messages = [{"role": "user", "content": "the cat sat"}]
    rendered = load_chat_template(directory).render(messages, add_generation_prompt=True)
    assert rendered == "<s>user the cat sat my"
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    expected = offline.generate([prompt_ids], greedy(6), use_tqdm=False)[0].outputs[0]
    reply = server.client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=6,
                                                  temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == offline.decode(expected.token_ids)
    assert reply.usage.prompt_tokens == len(prompt_ids) and reply.usage.completion_tokens == 6
    chunks = list(server.client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == reply.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6


# README's serve section: its three commands and its openai example, run against the server.
README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
README_MODEL = "/path/to/Llama-3.2-1B-Instruct"
README_URL = "http://127.0.0.1:8000"


def readme_serve_block(name: str, language: str) -> str:
    match = re.search(rf"<!-- test:serve {name} -->\n```{language}\n(.*?)\n```", README, re.DOTALL)
    assert match, f"README.md has no `test:serve {name}` {language} block"
    return match.group(1)


def on_the_test_server(text: str, server: Server) -> str:
    """README's model path and URL replaced by the test server's (each must occur)."""
    assert README_MODEL in text and README_URL in text
    return text.replace(README_MODEL, MODEL_NAME).replace(README_URL, server.url)


def test_readme_serve_commands_install_serve_and_stream(server, checkpoint):
    install, serve, curl = readme_serve_block("commands", "bash").replace("\\\n", " ").splitlines()
    # 1: the extras it installs exist.
    extras = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert shlex.split(install)[:4] == ["python3", "-m", "pip", "install"]
    named = re.fullmatch(r"\.\[([\w,-]+)\]", shlex.split(install)[4]).group(1).split(",")
    assert set(named) <= set(extras["project"]["optional-dependencies"]), named
    # 2: the console script exists and the server's own parser takes the command's flags.
    from jax_paged_attn.serve import cli

    argv = shlex.split(serve, comments=True)
    assert argv[:2] == ["jax-paged-attn", "serve"] and extras["project"]["scripts"]["jax-paged-attn"] == \
        "jax_paged_attn.serve.cli:command"
    parser = cli.build_parser()
    args = parser.parse_args([str(checkpoint[0]) if a == README_MODEL else a for a in argv[2:]])
    cli.check_server_args(args, parser)
    assert (args.port, args.max_num_seqs) == (8000, 64)
    # 3: curl's stream, as written, from the test server (plus its API key).
    done = subprocess.run([*shlex.split(on_the_test_server(curl, server)), "--silent", "--show-error", "--fail",
                           "-H", f"Authorization: Bearer {API_KEY}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    events = [line[len("data: "):] for line in done.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 2
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL_NAME for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    # max_tokens 16: one chunk per token (or per window's tokens), none empty
    assert 1 <= len(chunks) <= 16 and all(c["choices"][0]["text"] for c in chunks[:-1])


def test_readme_openai_example_streams_a_chat_answer(server):
    code = on_the_test_server(readme_serve_block("openai", "python"), server)
    assert code.count('api_key="unused"') == 1
    code = code.replace('api_key="unused"', f'api_key="{API_KEY}"')
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md:serve-openai", "exec"), {"__name__": "readme_serve_openai"})
    assert printed.getvalue().strip()


def test_stop_strings_end_the_text_as_offline(server, offline):
    candidates = [" ".join(sentence.split()[:k]) for sentence in CORPUS for k in (2, 3, 4)]
    outputs = offline.generate(candidates, greedy(12), use_tqdm=False)
    # A prompt whose output has a word first occurring mid-output: the stop string.
    prompt, stop = next((p, w) for p, out in zip(candidates, outputs) for words in [out.outputs[0].text.split()]
                        for w in words if words.index(w) > 0)
    for include in (False, True):
        params = greedy(12, stop=[stop], include_stop_str_in_output=include)
        expected = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert expected.finish_reason == "stop" and expected.stop_reason == stop
        extra = {"include_stop_str_in_output": include}
        reply = server.client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                 stop=stop, extra_body=extra)
        assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "stop"
        assert (stop in reply.choices[0].text) == include
        assert reply.usage.completion_tokens == len(expected.token_ids)
        chunks = server.client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                  stop=[stop], stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in chunks) == expected.text


def test_logprobs_match_offline(server, offline, checkpoint):
    _, tokenizer = checkpoint
    prompt = "a dog ran"
    expected = offline.generate([prompt], greedy(5, logprobs=2), use_tqdm=False)[0].outputs[0]
    reply = server.client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0,
                                             logprobs=2)
    got = reply.choices[0].logprobs
    token_text = [tokenizer.decode([t], skip_special_tokens=False) for t in expected.token_ids]
    assert got.tokens == token_text
    assert got.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(expected.token_ids, expected.logprobs)])
    assert [len(top) for top in got.top_logprobs] == [2] * 5
    chat = server.client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)  # greedy: the top one was drawn


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("payload, status, param, words", [
    (b'{"prompt": "the cat", "max_tokens": ', 400, None, "not valid JSON"),
    (b'["the cat"]', 400, None, "JSON object"),
    ({"prompt": "the cat", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"prompt": "the cat", "max_tokens": 2.5}, 400, "max_tokens", "must be an integer"),
    ({"prompt": "the cat", "top_p": 2}, 400, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": "the cat", "n": 0}, 400, "n", "n must be >= 1"),
    ({"prompt": "the cat", "stream": "yes"}, 400, "stream", "must be a boolean"),
    ({"prompt": 5}, 400, "prompt", "prompt must be"),
    ({"max_tokens": 4}, 400, "prompt", "prompt is required"),
    ({"prompt": "the " * 600}, 400, "prompt", "maximum context length is 512"),
    ({"prompt": "the cat", "max_tokens": 600}, 400, "max_tokens", "maximum context length is 512"),
    ({"prompt": [[1, 2, 9999]]}, 400, "prompt", "outside"),
    ({"prompt": "the cat", "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"prompt": "the cat", "presence_penalty": 2.5}, 400, "presence_penalty", "must be in [-2, 2]"),
    ({"prompt": "the cat", "repetition_penalty": "high"}, 400, "repetition_penalty", "must be a number"),
    ({"prompt": "the cat", "min_p": -0.1}, 400, "min_p", "min_p must be in [0, 1]"),
    ({"prompt": "the cat", "min_tokens": 20}, 400, "min_tokens", "max_tokens=16"),
    ({"prompt": "the cat", "logit_bias": {"cat": 5}}, 400, "logit_bias", "integers as strings"),
    ({"prompt": "the cat", "logit_bias": {"3": "up"}}, 400, "logit_bias", "must be a finite number"),
    ({"prompt": "the cat", "logit_bias": {"99999": 5}}, 400, "logit_bias", "lie outside the vocabulary"),
    ({"prompt": "the cat", "echo": True}, 400, "echo", "not supported yet"),
])
def test_bad_completion_requests_get_openai_errors(server, payload, status, param, words):
    got_status, body, _ = post(server, "/v1/completions", payload)
    assert got_status == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and words in body["error"]["message"], body
    assert "Traceback" not in json.dumps(body)
    if status == 404:
        assert body["error"]["code"] == "model_not_found"


def test_neutral_unsupported_values_and_nulls_are_accepted(server):
    status, body, _ = post(server, "/v1/completions", {
        "model": MODEL_NAME, "prompt": "the cat", "max_tokens": 2, "temperature": 0, "presence_penalty": 0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0, "logit_bias": {},
        "top_p": None, "seed": None, "stop": None, "n": None, "user": "ignored", "ignore_eos": True,
        "some_future_field": [1, 2]})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def test_penalties_and_logit_bias_over_http_match_offline(server, offline, checkpoint):
    """The penalties and ``logit_bias`` run as `LLM.generate` runs them (on the device)
    and change what greedy decoding picks."""
    _, tokenizer = checkpoint
    prompt = "the cat sat on"
    penalties = dict(frequency_penalty=1.2, presence_penalty=0.4, repetition_penalty=1.3, min_tokens=4)
    plain = offline.generate([prompt], greedy(10), use_tqdm=False)[0].outputs[0]
    expected = offline.generate([prompt], greedy(10, **penalties), use_tqdm=False)[0].outputs[0]
    assert expected.token_ids != plain.token_ids
    reply = server.client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0,
                                             frequency_penalty=1.2, presence_penalty=0.4,
                                             extra_body={"repetition_penalty": 1.3, "min_tokens": 4})
    assert reply.choices[0].text == expected.text
    # logit_bias over chat: "dog" pushed up (clamped to 100 as vLLM clamps), the greedy pick pushed down.
    messages = [{"role": "user", "content": "the cat sat"}]
    dog = tokenizer.token_to_id("dog")
    first = server.client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    bias = {str(dog): 150, str(tokenizer.token_to_id(first.choices[0].message.content.split()[0])): -100}
    biased = server.client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                                   temperature=0, logit_bias=bias)
    rendered = load_chat_template(checkpoint[0]).render(messages, add_generation_prompt=True)
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    offline_bias = {int(t): min(100.0, b) for t, b in bias.items()}
    want = offline.generate([ids], greedy(4, logit_bias=offline_bias), use_tqdm=False)[0].outputs[0]
    assert biased.choices[0].message.content == offline.decode(want.token_ids)
    assert biased.choices[0].message.content.split()[0] == "dog"


def test_chat_errors_and_api_key(server):
    status, body, _ = post(server, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body, _ = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert status == 400 and "text only" in body["error"]["message"]
    for key in (None, "wrong"):
        status, body, _ = post(server, "/v1/completions", {"prompt": "the cat"}, key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert get(server, "/health")[0] == 200 and "vllm:num_requests_running" in metrics(server)  # open routes
    with pytest.raises(openai().AuthenticationError):
        openai().OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    reply = server.client.completions.create(model=MODEL_NAME, prompt="the cat", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2  # still serving


# ---------------------------------------------------------------- load, disconnects
def test_concurrent_greedy_requests_match_offline(server, offline):
    num_requests = 64  # 16 times the engine's 4 sequence slots: most wait their turn
    prompts = [" ".join(CORPUS[i % 3].split()[i % 4:]) for i in range(num_requests)]
    lengths = [2 + i % 7 for i in range(num_requests)]
    expected = offline.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    compiles_before = metrics(server)["jax_paged_attn:xla_compilations_total"]

    def one(i: int) -> tuple[str, int]:
        status, body, _ = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": prompts[i],
                                                           "max_tokens": lengths[i], "temperature": 0})
        assert status == 200, body
        return body["choices"][0]["text"], body["usage"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        got = list(pool.map(one, range(num_requests)))
    assert got == [(e.outputs[0].text, len(e.outputs[0].token_ids)) for e in expected]
    assert wait_until(lambda: metrics(server)["vllm:num_requests_running"] == 0)
    # The warm-up compiled every program the batches' shapes reach (the penalties' aside, which
    # the penalties test compiled on first use): none compiles while these are served.
    assert metrics(server)["jax_paged_attn:xla_compilations_total"] == compiles_before


def test_the_http_benchmark_drives_the_server_with_the_offline_workload(server, checkpoint, capsys):
    """benchmarks/bench_http.py against the real server: every request streamed to its
    last token, at once and at Poisson arrivals of half the first run's rate."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_http

    vocab_size = checkpoint[1].get_vocab_size()
    rows = bench_http.main(["--url", server.url, "--api-key", API_KEY, "--num-requests", "6", "--rates", "inf,0.5x",
                            "--prompt-lens", "4,12", "--output-lens", "2,6", "--vocab-size", str(vocab_size)])
    workload = bench_http.make_workload(6, vocab_size, (4, 12), (2, 6))
    assert [rate for rate, _ in rows][0] == "inf" and rows[1][0].startswith("0.5x (")
    for _, result in rows:
        assert result["failed"] == 0 and result["requests"] == 6 and result["compiles"] == 0, result["errors"]
        assert result["output_tok_s"] * result["duration_s"] == pytest.approx(workload.output_tokens)
        assert all(v > 0 for v in result["ttft_ms"] + result["latency_ms"])
    assert "| 0.5x (" in capsys.readouterr().out
    started_at = time.time() - 1.0
    (_, start_up), = bench_http.main(["--url", server.url, "--api-key", API_KEY, "--wait-ready", "30",
                                      "--started-at", str(started_at)])
    assert 1.0 <= start_up["ready_s"] <= start_up["first_served_s"] <= time.time() - started_at
    assert "first request served after" in capsys.readouterr().out
    assert wait_until(lambda: metrics(server)["vllm:num_requests_running"] == 0)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    idle = metrics(server)
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps({
        "model": MODEL_NAME, "prompt": "the cat", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
        "stream": True}), {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")  # generating
    busy = metrics(server)
    assert busy["vllm:num_requests_running"] == 1 and busy["vllm:kv_cache_usage_perc"] > 0
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert wait_until(lambda: metrics(server).get(aborted, 0) == idle.get(aborted, 0) + 1), metrics(server)
    # The gauges follow at the engine loop's next pass (windows already in flight may still be read).
    assert wait_until(lambda: metrics(server)["vllm:num_requests_running"] == 0), metrics(server)
    after = metrics(server)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == idle["vllm:kv_cache_usage_perc"]
    assert after["vllm:generation_tokens_total"] - idle["vllm:generation_tokens_total"] < LONG


# ---------------------------------------------------------------- the front end in-process
def test_front_end_admission_limit_and_engine_failure(offline, monkeypatch):
    from jax_paged_attn.serve.async_engine import AsyncEngine, EngineError
    from jax_paged_attn.serve.protocol import ApiError

    front = AsyncEngine(offline, model_name="m", max_waiting_requests=2)  # capacity: 4 running + 2 waiting
    prompt = offline.encode("the cat")

    async def scenario() -> None:
        front.start()
        try:
            first = await front.generate([prompt] * 3, greedy(4, n=2))  # 6 sequences: full
            with pytest.raises(ApiError) as refused:
                await front.generate([prompt], greedy(4))
            assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
            async for _ in first:
                pass
            assert front.num_sequences == 0
            window = offline.engine.runner._window  # as tests/test_engine_failures.py breaks a program

            def failing_window(*args, **kwargs):
                window(*args, **kwargs)  # consumes the donated caches, as a failing device program does
                raise RuntimeError("injected device failure")

            monkeypatch.setattr(offline.engine.runner, "_window", failing_window)
            failing = await front.generate([prompt], greedy(LONG))
            with pytest.raises(EngineError):
                async for _ in failing:
                    pass
            monkeypatch.undo()
            assert not offline.engine.has_unfinished_requests() and front.num_sequences == 0
            again = await front.generate([prompt], greedy(3))
            assert [d.num_tokens for deltas in [x async for x in again] for d in deltas][-1] == 3
        finally:
            await front.stop()

    asyncio.run(scenario())


# ---------------------------------------------------------------- last: SIGTERM
def test_sigterm_finishes_running_requests_then_exits(server):
    results: dict[str, object] = {}
    started = threading.Event()

    def stream() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        connection.request("POST", "/v1/completions", json.dumps({
            "model": MODEL_NAME, "prompt": "the cat", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True}), {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        response = connection.getresponse()
        lines = [response.readline()]
        started.set()
        lines += response.read().splitlines()
        results["events"] = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
        results["done"] = b"data: [DONE]" in lines

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    server.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: _refused(server), 30)  # no new requests once it drains
    reader.join(120)
    server.process.wait(timeout=60)
    finish = [c["finish_reason"] for e in results["events"] for c in e["choices"] if c["finish_reason"]]
    assert finish == ["length"] and results["done"], server.log()


def test_an_engine_process_that_dies_fails_its_requests_and_the_server_stops_accepting(checkpoint, tmp_path):
    """The engine process killed mid-stream: the stream ends with an error event and
    [DONE] (never a hang), new requests and /health get 503, and the server still
    answers and exits on SIGTERM."""
    served = start_server(checkpoint[0], str(tmp_path / "server.log"), "--engine-core", "process", "--no-warmup")
    try:
        children = subprocess.run(["pgrep", "-P", str(served.process.pid), "-f", "spawn_main"],  # not the
                                  capture_output=True, text=True)  # resource tracker
        (engine_pid,) = [int(pid) for pid in children.stdout.split()]
        connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
        connection.request("POST", "/v1/completions", json.dumps({
            "model": MODEL_NAME, "prompt": "the cat", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True}), {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: {")  # generating
        os.kill(engine_pid, signal.SIGKILL)
        lines = response.read().splitlines()
        errors = [json.loads(line[6:]) for line in lines if line.startswith(b'data: {"error"')]
        assert errors and errors[-1]["error"]["type"] == "internal_server_error", lines[-3:]
        assert [line for line in lines if line][-1] == b"data: [DONE]"
        assert get(served, "/health")[0] == 503 and _refused(served)
        assert "the engine process exited" in served.log()
    finally:
        served.process.send_signal(signal.SIGTERM)
        # uvicorn raises the signal again once it has shut down: the exit of a SIGTERM.
        assert served.process.wait(timeout=60) in (0, -signal.SIGTERM), served.log()


def test_an_engine_process_that_cannot_start_ends_the_server_with_its_reason(checkpoint, tmp_path):
    """A checkpoint the engine process cannot load: the server exits with the engine
    process's error in its message, before any port opens."""
    directory = tmp_path / "broken"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((checkpoint[0] / name).read_bytes())
    (directory / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    done = subprocess.run([sys.executable, "-m", "jax_paged_attn.serve", str(directory), "--engine-core", "process",
                           "--port", str(free_port()), "--log-level", "warning"],
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode != 0
    assert "the engine process failed to start" in done.stderr and "NoSuchForCausalLM" in done.stderr, done.stderr[-2000:]


def test_the_engine_process_pipe_carries_params_and_deltas_as_json():
    """What crosses the pipe to an engine process is JSON, read back to equal objects:
    sampling parameters (stop strings, stop ids, logit_bias keys) and deltas (logprobs
    with -inf, their ranks and texts)."""
    from jax_paged_attn.engine import Logprob
    from jax_paged_attn.serve import engine_core
    from jax_paged_attn.serve.engine_loop import SequenceDelta

    params = SamplingParams(temperature=0.5, max_tokens=9, seed=3, stop=("a b", "c"), stop_token_ids=(4, 5),
                            logit_bias={7: -100.0, 2: 1.5}, logprobs=2, min_tokens=1, presence_penalty=0.5)
    wire = engine_core.decode(engine_core.encode(engine_core.params_to_json(params)))
    assert engine_core.params_from_json(wire) == params
    delta = SequenceDelta(index=1, text="é x", token_ids=[3, 9], stop_reason="x", finish_reason="stop", num_tokens=4,
                          logprobs=[{3: Logprob(-0.25, 1, "é"), 8: Logprob(float("-inf"), 900, None)},
                                    {9: Logprob(-1.0, 2, " x")}])
    events = [("deltas", {"req-1": [delta]}), ("added", "req-2", ("ValueError", "max_tokens must be >= 1")),
              ("finished", "stop", 0.5, 1.25, 4), ("load", 1, 2, 0, 0.25)]
    wire = engine_core.decode(engine_core.encode([engine_core._event_to_json(e) for e in events]))
    assert [engine_core._event_from_json(e) for e in wire] == events


def _refused(server: Server) -> bool:
    try:
        status, body, _ = post(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 1})
    except OSError:  # the listening socket is closed
        return True
    return status == 503 and body["error"]["type"] == "service_unavailable"


# ---------------------------------------------------------------- units (no server)
class BytesTokenizer:
    """Each id is a byte string; decoding joins them as ``tokenizers`` does (an
    incomplete UTF-8 sequence becomes U+FFFD)."""

    PIECES = {0: b"caf", 1: b"\xc3", 2: b"\xa9", 3: b" Obs", 4: b"erv", 5: b"ation", 6: b" ok", 7: b"</s>"}

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 7)).decode(errors="replace")


def test_sequence_text_holds_back_split_characters_and_stop_prefixes():
    from jax_paged_attn.serve.detokenizer import SequenceText

    text = SequenceText(BytesTokenizer(), ["Observation"], include_stop_str_in_output=False, skip_special_tokens=True)
    ids = [0, 1, 2, 3, 4, 5]
    pieces = [text.update(ids[:k], None, None) for k in range(1, 4)]
    assert pieces == ["caf", "", "é"]  # "\xc3" alone is held back, not sent as U+FFFD
    assert text.update(ids[:4], None, None) == " "  # "Obs" may start the stop string
    assert text.find_stop(ids[:5]) is None and text.update(ids[:5], None, None) == ""
    assert text.find_stop(ids) == (6, "Observation")  # the token that completed it is kept
    assert text.update(ids, "stop", "Observation") == "" and text.text == "café "
    tail = SequenceText(BytesTokenizer(), ["Observation"], include_stop_str_in_output=False,
                        skip_special_tokens=True)
    assert tail.update([3], None, None) == " " and tail.update([3, 6], None, None) == "Obs ok"
    eos = SequenceText(BytesTokenizer(), [], include_stop_str_in_output=True, skip_special_tokens=False)
    assert eos.update([6, 7], "stop", None) == " ok</s>"  # a stop token's text with include_stop_str_in_output


def _byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["café naïve über 日本語の文章 — ok", *CORPUS],
                                  trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def _metaspace_unigram():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(["café naïve über — ok", *CORPUS],
                                  trainers.UnigramTrainer(vocab_size=120, special_tokens=["<s>", "</s>"]))
    return tokenizer


@pytest.mark.parametrize("make", [word_tokenizer, _byte_level_bpe, _metaspace_unigram],
                         ids=["word-level", "byte-level-bpe", "metaspace-unigram"])
def test_incremental_text_is_the_whole_decode(make):
    """Streamed pieces (each step decoding only its tokens and their context) concatenate
    to the decode of the whole sequence, also over special tokens the text skips and the
    bytes of characters split over tokens, whatever the steps' sizes."""
    import numpy as np

    from jax_paged_attn.serve.detokenizer import INCOMPLETE_CHARACTER, SequenceText

    tokenizer = make()
    rng = np.random.default_rng(0)
    for trial in range(30):
        ids = rng.integers(0, tokenizer.get_vocab_size(), size=int(rng.integers(1, 60))).tolist()
        text = SequenceText(tokenizer, [], include_stop_str_in_output=False, skip_special_tokens=True)
        pieces, seen = [], 0
        while seen < len(ids) - 1:
            seen = min(len(ids) - 1, seen + int(rng.integers(1, 8)))
            pieces.append(text.update(ids[:seen], None, None))
            assert INCOMPLETE_CHARACTER not in pieces[-1][-1:], (trial, pieces)
        pieces.append(text.update(ids, "length", None))
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == text.text == whole, (trial, ids)


def test_sequence_text_looks_for_stop_strings_after_min_tokens():
    """vLLM looks for stop strings only in the text after the first ``min_tokens``
    tokens: " ok" in the first two is passed over, its next occurrence stops."""
    from jax_paged_attn.serve.detokenizer import SequenceText

    ids = [6, 0, 6, 0]  # " ok" "caf" " ok" "caf"
    plain = SequenceText(BytesTokenizer(), [" ok"], include_stop_str_in_output=True, skip_special_tokens=True)
    assert plain.find_stop(ids) == (1, " ok")
    held = SequenceText(BytesTokenizer(), [" ok"], include_stop_str_in_output=True, skip_special_tokens=True,
                        min_tokens=2)
    assert held.find_stop(ids[:2]) is None and held.find_stop(ids) == (3, " ok")
    assert held.update(ids[:3], "stop", " ok") == " okcaf ok" and held.text == " okcaf ok"


def test_chat_template_loading_and_rendering(tmp_path):
    from jax_paged_attn.serve.chat_template import ChatTemplateError, load_chat_template

    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}, "chat_template": [
        {"name": "default", "template": "  {% for m in messages %}\n{{ m.content | tojson }}{{ eos_token }}"
                                        "{% endfor %}{% if messages|length > 1 %}{{ raise_exception('one') }}"
                                        "{% endif %}"}]}))
    template = load_chat_template(tmp_path)
    assert template.render([{"role": "user", "content": "é"}]) == '"é"</s>'  # trim/lstrip blocks, no ASCII escapes
    with pytest.raises(ChatTemplateError, match="one"):
        template.render([{"role": "user", "content": "a"}] * 2)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "x"}]) == "x"


@pytest.mark.parametrize("flags, named", [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--block-size", "20"], "--block-size"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--port", "70000"], "--port"),
    (["--engine-options", '{"no_such_field": 1}'], "--engine-options"),
    (["--engine-options", '{"max_num_seqs": 3}'], "--engine-options"),
    (["--dtype", "int8"], "--dtype"),
])
def test_bad_flags_are_argparse_errors_naming_the_flag(checkpoint, capsys, flags, named):
    from jax_paged_attn.serve import cli

    with pytest.raises(SystemExit) as exited:  # (the thread core: no engine process spawned per case)
        cli.main([str(checkpoint[0]), *flags, "--engine-core", "thread"])
    assert exited.value.code == 2 and named in capsys.readouterr().err


def test_refused_flags_end_the_engine_process_spawned_before_them(checkpoint, capsys):
    """The server spawns its engine process before it checks the flags (so the engine's
    imports overlap its own, `jax_paged_attn.serve.engine_process`); a refused flag ends
    that process, and the server's command line imports no JAX before spawning it."""
    import multiprocessing

    from jax_paged_attn.serve import cli

    spawned = []
    real = cli.spawn_engine_process_early
    cli.spawn_engine_process_early = lambda argv: spawned.append(real(argv)) or spawned[-1]
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main([str(checkpoint[0]), "--max-num-seqs", "0"])
    finally:
        cli.spawn_engine_process_early = real
    assert exited.value.code == 2 and "--max-num-seqs" in capsys.readouterr().err
    (process,) = spawned
    assert process is not None and not process.process.is_alive() and not process.started
    assert process.process not in multiprocessing.active_children()
    assert cli.spawn_engine_process_early(["--help"]) is None  # help, or the thread core: nothing spawned
    assert cli.spawn_engine_process_early(["m", "--engine-core", "thread"]) is None
    abbreviated = cli.spawn_engine_process_early(["m", "--engine-c", "thread"])  # the full parser's to resolve
    assert abbreviated is not None
    abbreviated.cancel()
    assert not abbreviated.process.is_alive()
    probe = "import sys, jax_paged_attn.serve.cli, jax_paged_attn.serve.engine_process; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.stdout.strip() == "False", done.stderr
