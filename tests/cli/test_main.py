"""`pdserve` command line: flags per the CLI contract, CPU placement, the `generate` client
against a fake Generation service, and the `serve` supervisor with fake child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from services.cli import main as cli
from services.cluster import launcher
from services.common.errors import ServiceUnavailableError
from services.common.grpc_server import start_service
from services.common.pb import generate_pb2, generate_pb2_grpc
from services.config.handoff import to_json

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def parse(*argv: str):
    return cli._parser().parse_args(list(argv))


# --- flags ---------------------------------------------------------------------------------


def config(*argv: str):
    """The role config a service command's flags describe."""
    return cli.service_config(parse(*argv))


def test_serve_contract_flags_and_defaults():
    c = config("serve")
    assert (c.engine.model, c.router.host, c.router.port, c.router.http_port) == (
        "smollm2-135m-instruct",
        "127.0.0.1",
        50051,
        8000,
    )
    assert (c.num_prefill, c.num_decode, c.engine.block_size) == (1, 1, 16)
    assert (c.engine.dtype, c.engine.max_model_len, c.start_timeout) == (None, None, 120.0)
    # the flags of the CLI contract, each landing in its field
    c = config(
        "serve",
        "--model",
        "/m",
        "--host",
        "0.0.0.0",
        "--port",
        "1",
        "--http-port",
        "2",
        "--num-prefill",
        "3",
        "--num-decode",
        "4",
        "--block-size",
        "32",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--prefill-threads",
        "2",
        "--decode-threads",
        "1",
        "--prefill-cpus",
        "0-1",
        "--decode-cpus",
        "1",
        "--redis-url",
        "redis://h:1/0",
    )
    assert (c.engine.model, c.router.host, c.router.port, c.router.http_port) == (
        "/m",
        "0.0.0.0",
        1,
        2,
    )
    assert (c.num_prefill, c.num_decode, c.index.redis_url) == (3, 4, "redis://h:1/0")
    # --host is the router's alone: workers stay on loopback unless --worker-host says otherwise
    assert (c.prefill_config(0).host, c.decode_config(0).host) == ("127.0.0.1", "127.0.0.1")
    c2 = config("serve", "--worker-host", "0.0.0.0")
    assert (c2.router.host, c2.prefill_config(0).host, c2.decode_config(0).host) == (
        "127.0.0.1",
        "0.0.0.0",
        "0.0.0.0",
    )
    rpcs = ("--max-concurrent-rpcs", "10", "--prefill-max-concurrent-rpcs", "20")
    c2 = config("serve", *rpcs, "--decode-max-concurrent-rpcs", "30")
    assert (c2.router.max_concurrent_rpcs, c2.prefill.max_concurrent_rpcs) == (10, 20)
    assert c2.decode.max_concurrent_rpcs == 30 and c.router.max_concurrent_rpcs is None
    assert (c.engine.block_size, c.engine.dtype, c.engine.max_model_len) == (32, "bfloat16", 512)
    assert (c.prefill.threads, c.decode.threads, c.prefill.cpus, c.decode.cpus) == (
        2,
        1,
        "0-1",
        "1",
    )
    assert config("serve", "--no-http").router.http_port is None


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_flags_and_defaults(role):
    c = config(role)
    assert (c.engine.model, c.host, c.port, c.metrics_port) == (
        "smollm2-135m-instruct",
        "127.0.0.1",
        0,
        0,
    )
    e = c.engine
    assert (e.block_size, e.dtype, e.max_model_len, e.num_blocks) == (16, None, None, None)
    # The KV budget: 1 GiB on the CPU, on CUDA what --gpu-memory-utilization leaves (memory.py).
    assert (e.kv_cache_memory_bytes, e.max_num_seqs, e.max_num_batched_tokens) == (
        None,
        256,
        8192,
    )
    assert (e.gpu_memory_utilization, e.enforce_eager, e.max_cuda_graph_batch_size) == (
        0.9,
        False,
        256,
    )
    gpu = config(role, "--gpu-memory-utilization", "0.5", "--enforce-eager").engine
    assert (gpu.gpu_memory_utilization, gpu.enforce_eager) == (0.5, True)
    with pytest.raises(ValueError, match=r"^--gpu-memory-utilization: must be in \(0, 1\]"):
        config(role, "--gpu-memory-utilization", "1.5")
    assert (c.threads, c.cpus, c.engine_config().role.value) == (None, None, role)
    c = config(
        role,
        "--kv-cache-bytes",
        "1000",
        "--threads",
        "2",
        "--cpus",
        "0,1",
        "--engine-id",
        "e1",
        "--num-blocks",
        "64",
        "--dtype",
        "float16",
    )
    assert (c.engine.kv_cache_memory_bytes, c.threads, c.cpus, c.engine.engine_id) == (
        1000,
        2,
        "0,1",
        "e1",
    )
    assert (c.engine.num_blocks, c.engine.dtype) == (64, "float16")
    help_text = cli._parser()._subparsers._group_actions[0].choices[role].format_help()
    if role == "prefill":
        assert config(role, "--kv-lease-seconds", "5").engine.kv_lease_seconds == 5.0
        assert "--kv-transfer-timeout" not in help_text
    else:
        assert config(role, "--kv-transfer-timeout", "2").engine.kv_transfer_timeout_s == 2.0
        assert config("decode", "--debug-zero-kv-block", "3").debug_zero_kv_block == 3
        assert "debug-zero-kv-block" not in help_text and "--kv-lease-seconds" not in help_text


def test_router_flags_and_defaults():
    c = config("router", "--prefill", "h:1", "--prefill", "h:2", "--decode", "h:3")
    assert (c.model, c.host, c.port, c.metrics_port) == (
        "smollm2-135m-instruct",
        "127.0.0.1",
        50051,
        0,
    )
    assert (c.prefill, c.decode, c.request_timeout, c.http_port) == (
        ("h:1", "h:2"),
        ("h:3",),
        300.0,
        None,
    )
    assert config("router", "--routing", "round_robin").routing == "round_robin"


def test_config_json_round_trips_and_replaces_the_flags():
    c = config("serve", "--block-size", "32", "--prefill-threads", "1", "--no-http")
    child = c.prefill_config(0)
    assert config("prefill", "--config-json", to_json(child)) == child
    assert config("serve", "--config-json", to_json(c)) == c
    with pytest.raises(ValueError, match="^bogus: not a field of RouterConfig"):
        config("router", "--config-json", '{"bogus": 1}')


def test_generate_contract_flags_and_defaults(capsys):
    args = parse("generate", "--prompt", "hi")
    assert (args.url, args.prompt, args.max_tokens, args.temperature, args.top_p, args.top_k) == (
        "127.0.0.1:50051",
        "hi",
        64,
        0.0,
        1.0,
        -1,
    )
    assert (args.seed, args.stop, args.ignore_eos, args.json, args.timeout) == (
        None,
        [],
        False,
        False,
        300.0,
    )
    args = parse(
        "generate",
        "--url",
        "h:9",
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "5",
        "--temperature",
        "0.7",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "7",
        "--stop",
        "a",
        "--stop",
        "b",
        "--ignore-eos",
        "--json",
        "--timeout",
        "2.5",
    )
    assert (
        args.url,
        args.prompt_ids,
        args.max_tokens,
        args.temperature,
        args.top_p,
        args.top_k,
        args.seed,
    ) == ("h:9", "1,2,3", 5, 0.7, 0.9, 40, 7)
    assert (args.stop, args.ignore_eos, args.json, args.timeout) == (["a", "b"], True, True, 2.5)
    assert parse("generate", "--chat", "hello").chat == "hello"
    for argv in (["generate"], ["generate", "--prompt", "a", "--chat", "b"]):
        with pytest.raises(SystemExit):
            parse(*argv)
    capsys.readouterr()


def test_help_imports_no_heavy_packages():
    code = (
        "import sys; from services.cli import main as cli; from services.cluster import launcher; "
        "cli._parser().format_help(); "
        "heavy = {'torch', 'transformers', 'grpc'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, check=True, timeout=60)


def test_serve_passes_its_configs_to_its_children():
    c = config(
        "serve",
        "--model",
        "/m",
        "--dtype",
        "bfloat16",
        "--block-size",
        "32",
        "--max-model-len",
        "256",
        "--kv-cache-bytes",
        "4096",
        "--num-prefill",
        "2",
        "--prefill-cpus",
        "0",
        "--decode-threads",
        "1",
        "--port",
        "6000",
        "--kv-transfer-timeout",
        "2",
        "--routing",
        "least_loaded",
    )
    spec = launcher.cluster_spec(c)
    assert [(w.name, w.role) for w in spec.workers] == [
        ("prefill-0", "prefill"),
        ("prefill-1", "prefill"),
        ("decode-0", "decode"),
    ]
    assert spec.workers[0].argv[:4] == [sys.executable, "-m", "services.cli.main", "prefill"]
    prefill, decode = (cli.service_config(parse(*w.argv[3:])) for w in spec.workers[::2])
    assert (prefill, decode) == (spec.workers[0].config, spec.workers[2].config)
    for worker in (prefill, decode):
        e = worker.engine
        assert (e.model, e.dtype, e.block_size, e.max_model_len) == ("/m", "bfloat16", 32, 256)
        assert (worker.port, worker.metrics_port, e.kv_cache_memory_bytes) == (0, 0, 4096)
    assert (prefill.cpus, prefill.threads) == ("0", None)
    assert (decode.cpus, decode.threads, decode.engine.kv_transfer_timeout_s) == (None, 1, 2.0)
    ids = {w.config.engine.engine_id for w in spec.workers}
    assert len(ids) == 3 and all(i.startswith(("prefill-", "decode-")) for i in ids)
    router = spec.router(["h:1", "h:2"], ["h:3"])
    assert router.role == "router"
    parsed = cli.service_config(parse(*router.argv[3:]))
    assert parsed == router.config
    assert (parsed.prefill, parsed.decode, parsed.port, parsed.http_port) == (
        ("h:1", "h:2"),
        ("h:3",),
        6000,
        8000,
    )
    assert parsed.max_model_len == 256  # the router refuses what the workers would
    assert parsed.routing == "least_loaded"
    no_http = launcher.cluster_spec(config("serve", "--no-http")).router(["a:1"], ["b:2"])
    assert no_http.config.http_port is None


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--num-prefill", "0"], "--num-prefill"),
        (["--num-decode", "-1"], "--num-decode"),
        (["--prefill-cpus", "x"], "--prefill-cpus"),
        (["--decode-cpus", "99999"], "--decode-cpus"),
        (["--prefill-threads", "0"], "--prefill-threads"),
    ],
)
def test_serve_rejects_bad_flags_before_starting_anything(capsys, argv, flag):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve: error: {flag}: ") and err.count("\n") == 1


def test_worker_command_reports_bad_cpus_in_one_line(capsys):
    assert cli.main(["prefill", "--cpus", "3-1"]) == 2
    assert (
        capsys.readouterr().err
        == "pdserve: error: --cpus: expected CPU ids like 0,1 or 0-3, got '3-1'\n"
    )


# --- generate against a fake router --------------------------------------------------------


class FakeGeneration(generate_pb2_grpc.GenerationServicer):
    """Streams "Hel" + "lo"; the prompt text "invalid" / "unavailable" fails the call."""

    def __init__(self) -> None:
        self.requests: list[generate_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        if request.text == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be >= 1")
        if request.text == "unavailable":
            raise ServiceUnavailableError("no healthy decode worker")
        yield generate_pb2.GenerateResponse(token_ids=[5, 6], text="Hel")
        yield generate_pb2.GenerateResponse(
            token_ids=[7],
            text="lo",
            finish_reason="length",
            usage=generate_pb2.Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=1),
            timings=generate_pb2.Timings(
                ttft=0.5,
                e2e=1.5,
                tokenize=0.25,
                prefill=0.125,
                kv_transfer=0.0625,
                decode=1.0,
                router_queue=0.001,
                prefill_queue=0.0625,
                decode_queue=0.03125,
                first_decode_step=0.015625,
                path="remote",
                path_reason="predicted",
                predicted_ttft_local=0.75,
                predicted_ttft_remote=0.5,
            ),  # fmt: skip
        )


@pytest.fixture(scope="module")
def fake_router():
    servicer = FakeGeneration()
    service = start_service(
        "router",
        [(generate_pb2_grpc.add_GenerationServicer_to_server, servicer, "pdserve.v1.Generation")],
        "127.0.0.1",
        0,
        0,
    )
    yield service.grpc_address, servicer
    service.server.stop(0).wait()


def test_generate_json(fake_router, capsys):
    url, servicer = fake_router
    argv = [
        "generate",
        "--url",
        url,
        "--prompt",
        "hi",
        "--json",
        "--max-tokens",
        "3",
        "--seed",
        "7",
        "--stop",
        "a",
        "--stop",
        "b",
        "--ignore-eos",
        "--temperature",
        "0.5",
        "--top-k",
        "5",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert json.loads(out) == {
        "text": "Hello",
        "token_ids": [5, 6, 7],
        "finish_reason": "length",
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 1},
        "timings": {
            "ttft": 0.5,
            "e2e": 1.5,
            "tokenize": 0.25,
            "prefill": 0.125,
            "kv_transfer": 0.0625,
            "decode": 1.0,
            "router_queue": 0.001,
            "prefill_queue": 0.0625,
            "decode_queue": 0.03125,
            "first_decode_step": 0.015625,
            "path": "remote",
            "migrations": 0,
            "migration": 0.0,
            "path_reason": "predicted",
            "predicted_ttft_local": 0.75,
            "predicted_ttft_remote": 0.5,
        },
    }
    request = servicer.requests[-1]
    assert request.WhichOneof("prompt") == "text" and request.text == "hi"
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.seed, list(sampling.stop), sampling.ignore_eos) == (
        3,
        7,
        ["a", "b"],
        True,
    )
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 1.0, 5)


def test_generate_sends_penalties_and_logit_bias(fake_router, capsys):
    url, servicer = fake_router
    flags = [
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "-1",
        "--repetition-penalty",
        "1.5",
    ]
    argv = ["generate", "--url", url, "--prompt", "hi", *flags, "--logit-bias", "5:-100, 7:2.5"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    sampling = servicer.requests[-1].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.repetition_penalty == 1.5 and dict(sampling.logit_bias) == {5: -100, 7: 2.5}
    assert cli.main(["generate", "--url", url, "--prompt", "hi"]) == 0
    capsys.readouterr()
    sampling = servicer.requests[-1].sampling
    assert not sampling.HasField("presence_penalty") and not sampling.logit_bias


def test_generate_streams_text(fake_router, capsys):
    url, servicer = fake_router
    assert cli.main(["generate", "--url", url, "--chat", "Say hello"]) == 0
    assert capsys.readouterr().out == "Hello\n"
    request = servicer.requests[-1]
    assert request.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [("user", "Say hello")]
    assert not request.sampling.HasField("seed") and request.sampling.temperature == 0.0

    assert cli.main(["generate", "--url", url, "--prompt-ids", "1,2,3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "Hello"
    assert list(servicer.requests[-1].token_ids.ids) == [1, 2, 3]


@pytest.mark.parametrize(
    "prompt, code, status",
    [
        ("invalid", 2, "INVALID_ARGUMENT: max_tokens: must be >= 1"),
        ("unavailable", 1, "UNAVAILABLE: no healthy decode worker"),
    ],
)
def test_generate_error_status(fake_router, capsys, prompt, code, status):
    url, _ = fake_router
    assert cli.main(["generate", "--url", url, "--prompt", prompt, "--json"]) == code
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"pdserve: error: {status}\n"


def test_generate_without_a_server_fails_fast(capsys):
    start = time.monotonic()
    assert cli.main(["generate", "--url", "127.0.0.1:1", "--prompt", "hi", "--timeout", "20"]) == 1
    assert time.monotonic() - start < 15
    assert capsys.readouterr().err.startswith("pdserve: error: UNAVAILABLE: ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-ids", "1,x"], "prompt-ids: expected comma-separated integers"),
        (["--prompt", "hi", "--seed", "-1"], "--seed: must be in [0, 2**64)"),
        (
            ["--prompt", "hi", "--presence-penalty", "3"],
            "presence_penalty: must be in [-2, 2], got 3.0",
        ),
        (
            ["--prompt", "hi", "--repetition-penalty", "0"],
            "repetition_penalty: must be a finite number > 0",
        ),
        (["--prompt", "hi", "--logit-bias", "5"], "logit-bias: expected ID:BIAS,..."),
        (
            ["--prompt", "hi", "--logit-bias", "5:101"],
            "logit_bias: must be in [-100, 100], got 101.0",
        ),
    ],
)
def test_generate_rejects_bad_input_before_sending(fake_router, capsys, argv, message):
    url, servicer = fake_router
    sent = len(servicer.requests)
    assert cli.main(["generate", "--url", url, *argv]) == 2
    assert capsys.readouterr().err.startswith(f"pdserve: error: {message}")
    assert len(servicer.requests) == sent


# --- errors a user meets first: one line naming the flag or the JSON field -----------------


@pytest.mark.parametrize(
    "config_json, message",
    [
        ('{"engine": {"device": 5}}', "engine.device: expected str, got 5"),
        ('{"prefill": {"cpus": 7}}', "prefill.cpus: expected str, got 7"),
        ('{"decode": {"threads": "2"}}', "decode.threads: expected int, got '2'"),
        ('{"engine": {"role": "bogus"}}', "engine.role: expected one of"),
        ('{"decode": {"threads": 0}}', "decode.threads: must be >= 1"),
        ('{"prefill": {"port": 5}}', "prefill.port: set by the cluster"),
        ('{"prefill": {"engine": {"block_size": 32}}}', "prefill.engine: set by the cluster"),
        ('{"router": {"prefill": ["h:1"]}}', "router.prefill: set by the cluster"),
        ('{"router": {"bogus": 1}}', "router.bogus: not a field of RouterConfig"),
    ],
)
def test_bad_config_json_is_one_line_naming_the_field(capsys, config_json, message):
    assert cli.main(["serve", "--config-json", config_json]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve: error: {message}") and err.count("\n") == 1, err


def test_config_json_given_in_part_keeps_the_commands_defaults():
    c = config("serve", "--config-json", '{"router": {"port": 0}, "engine": {"block_size": 8}}')
    assert (c.router.port, c.router.http_port, c.engine.block_size) == (0, 8000, 8)
    assert c.engine.max_num_seqs == 256


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cudafoo"], "--device: expected 'cpu' or 'cuda[:N]'"),
        (["--redis-url", "http://127.0.0.1:1"], "--redis-url: must be a redis:// URL"),
        (["--host", ""], "--host: must be a host name or address"),
        (["--max-model-len", "100000"], "--max-model-len: 100000 exceeds the model's"),
    ],
)
def test_serve_refuses_values_its_children_would_refuse_before_starting(capsys, argv, message):
    started = time.monotonic()
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve: error: {message}") and err.count("\n") == 1, err
    assert time.monotonic() - started < 30  # nothing was started


def test_serve_refuses_a_folder_that_is_no_model(capsys, tmp_path):
    assert cli.main(["serve", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("pdserve: error: --model: ")


def test_a_port_in_use_is_one_line_naming_the_flag(capsys, tiny_llama):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flag in ("--port", "--metrics-port", "--http-port"):
            argv = ["router", "--model", tiny_llama, "--port", "0", "--http-port", "0", flag]
            assert cli.main([*argv, str(port)]) == 2
            err = capsys.readouterr().err  # log lines (a warning) may come before it
            errors = [line for line in err.splitlines() if line.startswith("pdserve: error:")]
            assert len(errors) == 1, err
            assert errors[0].startswith(f"pdserve: error: {flag}: cannot bind 127.0.0.1:{port}")


def test_generate_refuses_a_timeout_that_is_not_positive(capsys):
    assert cli.main(["generate", "--url", "127.0.0.1:1", "--prompt", "x", "--timeout", "0"]) == 2
    assert capsys.readouterr().err.startswith("pdserve: error: --timeout: must be > 0")
