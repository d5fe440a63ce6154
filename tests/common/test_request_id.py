"""One request id: accepted from x-request-id metadata, generated where the router gets none,
bound while a handler runs (on every thread that resumes its stream), and in every log record;
the log set-up around it: the level from $PDSERVE_LOGGING_LEVEL and `--log-file`."""

from __future__ import annotations

import json
import logging
from concurrent import futures

import grpc
import pytest

from services.common import logs, request_id
from services.common.errors import ErrorInterceptor
from services.engine.errors import InvalidRequestError


def test_accept_keeps_plain_ids_and_refuses_odd_ones():
    assert request_id.accept("abc-123_x.y:z/w@q+=") == "abc-123_x.y:z/w@q+="
    assert request_id.accept(b"bytes-id") == "bytes-id"
    for bad in ("", None, "has space", 'quote"', "x" * 129, "new\nline", "café", b"caf\xe9"):
        assert request_id.accept(bad) is None
    assert request_id.from_metadata([("other", "1"), ("x-request-id", "mine")]) == "mine"
    assert request_id.from_metadata([("x-request-id", "bad id")]) is None
    assert len(request_id.new_request_id()) == 32


def test_bind_stream_binds_each_step_on_whichever_thread_resumes_it():
    seen = []

    def stream():
        for i in range(4):
            seen.append((i, request_id.current.get()))
            yield i

    bound = request_id.bind_stream(stream(), "rid-1")
    pool = futures.ThreadPoolExecutor(2)
    items = [pool.submit(next, bound).result() for _ in range(4)]  # resumed on pool threads
    assert items == [0, 1, 2, 3]
    assert seen == [(i, "rid-1") for i in range(4)]
    assert request_id.current.get() is None  # nothing leaks onto the caller's thread
    pool.shutdown()


def test_json_logs_carry_the_bound_id_and_the_role(capsys, restore_logging):
    logs.configure("json", "decode")
    with request_id.bound("rid-json"):
        logging.getLogger("pdserve.test").warning("pulled %d blocks", 3)
    logging.getLogger("pdserve.test").warning("no request")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert lines[0]["message"] == "pulled 3 blocks" and lines[0]["request_id"] == "rid-json"
    assert lines[0]["role"] == "decode" and lines[0]["level"] == "WARNING"
    assert lines[1]["request_id"] == "-"
    logs.configure("text", "router")
    with request_id.bound("rid-text"):
        logging.getLogger("pdserve.test").warning("hello")
    assert "[router] pdserve.test request_id=rid-text: hello" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^log_format"):
        logs.configure("xml", "router")


def test_the_level_comes_from_pdserve_logging_level(capsys, monkeypatch, restore_logging):
    log = logging.getLogger("pdserve.test")
    monkeypatch.delenv("PDSERVE_LOGGING_LEVEL", raising=False)
    logs.configure("text", "router")  # default: INFO
    log.debug("hidden debug")
    log.info("shown info")
    monkeypatch.setenv("PDSERVE_LOGGING_LEVEL", "warning")  # any case, as vLLM's
    logs.configure("text", "router")
    log.info("hidden info")
    log.warning("shown warning")
    monkeypatch.setenv("PDSERVE_LOGGING_LEVEL", "DEBUG")
    logs.configure("json", "decode")
    log.debug("shown debug")
    err = capsys.readouterr().err
    assert "shown info" in err and "shown warning" in err and "shown debug" in err
    assert "hidden" not in err
    assert json.loads(err.splitlines()[-1])["level"] == "DEBUG"
    monkeypatch.setenv("PDSERVE_LOGGING_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="^PDSERVE_LOGGING_LEVEL: expected one of DEBUG, .*'LOUD'"):
        logs.configure("text", "router")


def test_a_bad_level_stops_a_service_command_in_one_line(capsys, monkeypatch, restore_logging):
    from services.cli import main as cli

    monkeypatch.setenv("PDSERVE_LOGGING_LEVEL", "verbose")
    assert cli.main(["router", "--port", "0"]) == 2  # refused before anything starts
    assert capsys.readouterr().err == (
        "pdserve: error: PDSERVE_LOGGING_LEVEL: expected one of DEBUG, INFO, WARNING, ERROR, "
        "CRITICAL, got 'verbose'\n"
    )


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_log_file_gets_the_same_lines_as_stderr(
    tmp_path, capsys, log_format, monkeypatch, restore_logging
):
    monkeypatch.delenv("PDSERVE_LOGGING_LEVEL", raising=False)
    path = tmp_path / "pdserve.log"
    path.write_text("an earlier run\n")
    logs.configure(log_format, "decode", log_file=str(path))
    assert logs.current_format() == log_format
    with request_id.bound("rid-file"):
        logging.getLogger("pdserve.test").info("pulled %d blocks", 3)
    logging.getLogger("pdserve.test").debug("below the level")
    logs.write_line("[prefill-0] a relayed line")  # what `pdserve serve` relays
    err = capsys.readouterr().err.splitlines()
    lines = path.read_text().splitlines()
    assert lines == ["an earlier run", *err]  # appended, whole lines, in order
    assert len(err) == 2 and err[1] == "[prefill-0] a relayed line"
    if log_format == "json":
        record = json.loads(err[0])
        assert (record["message"], record["request_id"]) == ("pulled 3 blocks", "rid-file")
    else:
        assert "INFO [decode] pdserve.test request_id=rid-file: pulled 3 blocks" in err[0]
    logs.configure("text", "decode")  # a second call replaces (and closes) the file handler
    logging.getLogger("pdserve.test").info("stderr only")
    assert "stderr only" in capsys.readouterr().err
    assert "stderr only" not in path.read_text()


def test_a_log_file_that_cannot_be_opened_is_one_line_naming_the_flag(
    tmp_path, capsys, restore_logging
):
    from services.cli import main as cli

    with pytest.raises(ValueError, match="^log_file: cannot append to "):
        logs.configure("text", "router", log_file=str(tmp_path))  # a folder
    missing = tmp_path / "missing" / "x.log"
    assert cli.main(["router", "--port", "0", "--log-file", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"pdserve: error: --log-file: cannot append to {str(missing)!r}: "
        "No such file or directory\n"
    )


@pytest.mark.parametrize("new_ids", [False, True])
def test_the_interceptor_binds_the_metadata_id_or_a_new_one(new_ids):
    seen: list[str | None] = []

    def unary(request, context):
        seen.append(request_id.current.get())
        if request == b"bad":
            raise InvalidRequestError("prompt", "bad")
        return b"ok"

    def stream(request, context):
        seen.append(request_id.current.get())
        yield b"1"
        seen.append(request_id.current.get())
        yield b"2"

    handlers = grpc.method_handlers_generic_handler(
        "t.T",
        {
            "U": grpc.unary_unary_rpc_method_handler(unary),
            "S": grpc.unary_stream_rpc_method_handler(stream),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(4), interceptors=[ErrorInterceptor(new_request_ids=new_ids)]
    )
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        md = (("x-request-id", "client-id"),)
        assert channel.unary_unary("/t.T/U")(b"x", metadata=md) == b"ok"
        assert list(channel.unary_stream("/t.T/S")(b"x", metadata=md)) == [b"1", b"2"]
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/t.T/U")(b"bad", metadata=md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert seen == ["client-id"] * 4
        seen.clear()
        channel.unary_unary("/t.T/U")(b"x")
        assert (seen[0] is not None) == new_ids and seen[0] != "client-id"
    finally:
        server.stop(0)


def test_targets_paths_are_refused_before_anything_starts(tmp_path, capsys):
    from services.cli import main as cli
    from services.cluster.prometheus_targets import check_path, write_targets

    for path, why in (
        (tmp_path, "is a folder"),
        (tmp_path / "missing" / "t.json", "does not exist"),
        (tmp_path / "t.yaml", "must end in .json"),
    ):
        with pytest.raises(ValueError, match=f"^prometheus_targets: .*{why}"):
            check_path(str(path))
    assert cli.main(["serve", "--prometheus-targets", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("pdserve: error: --prometheus-targets: ")
    target = tmp_path / "t.json"
    write_targets(str(target), [{"targets": ["127.0.0.1:1"], "labels": {}}])
    assert json.loads(target.read_text())[0]["targets"] == ["127.0.0.1:1"]
    with pytest.raises(OSError, match="^prometheus_targets: cannot write"):
        write_targets(str(tmp_path), [])  # a folder: the rename fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # no temporary file left
