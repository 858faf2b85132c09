"""The one logging set-up: text lines with context, or JSON lines."""

import json
import logging

from gateway.app.logs import JsonFormatter, TextFormatter, setup_logging


def make_record(msg="segment rolled", ctx=None, exc_info=None):
    record = logging.LogRecord("store.log.commitlog", logging.WARNING, __file__, 1, msg, (), exc_info)
    if ctx is not None:
        record.ctx = ctx
    return record


def test_text_line_carries_level_logger_message_and_context():
    line = TextFormatter().format(make_record(ctx={"dropped_bytes": 17, "reason": "crc"}))
    assert " WARNING store.log.commitlog: segment rolled dropped_bytes=17 reason=crc" in line
    assert line[:4].isdigit() and "Z " in line


def test_json_line_is_one_object_with_context_fields():
    doc = json.loads(JsonFormatter().format(make_record(ctx={"client_id": "dev-1"})))
    assert doc["level"] == "warning"
    assert doc["logger"] == "store.log.commitlog"
    assert doc["msg"] == "segment rolled"
    assert doc["client_id"] == "dev-1"


def test_json_line_includes_exception_text():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        doc = json.loads(JsonFormatter().format(make_record(exc_info=sys.exc_info())))
    assert "ValueError: boom" in doc["exc"]


def test_setup_logging_replaces_handlers(capsys):
    setup_logging("debug", json_lines=True)
    setup_logging("info", json_lines=True)
    root = logging.getLogger()
    assert len(root.handlers) == 1 and root.level == logging.INFO
    logging.getLogger("x").info("hello", extra={"ctx": {"n": 1}})
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert json.loads(err)["n"] == 1


SECRET = 'tok"en\\1'  # quotes and backslashes: JSON escapes them, the redaction must still find the password


def test_a_uri_password_never_reaches_a_line_in_either_format(capsys):
    try:
        for json_lines in (False, True):
            setup_logging("info", json_lines=json_lines)
            log = logging.getLogger("x")
            log.warning("tier at s3://k:%s@b/lg failed", SECRET, extra={"ctx": {"uri": f"s3://k:{SECRET}@b"}})
            try:
                raise ValueError(f"cannot parse s3://k:{SECRET}@b")
            except ValueError:
                log.exception("tier failed")
            err = capsys.readouterr().err
            assert SECRET not in err and json.dumps(SECRET)[1:-1] not in err
            assert err.count("s3://k:<redacted>@b") == 4, err
            if json_lines:
                docs = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
                assert docs[0]["msg"] == "tier at s3://k:<redacted>@b/lg failed" and docs[0]["uri"] == "s3://k:<redacted>@b"
    finally:
        setup_logging("info")


def test_nothing_but_uri_passwords_is_ever_replaced(capsys):
    """A line is never searched for a secret's value: words, addresses and URIs without a password stay whole."""
    lines = ["gateway node ready: t, tt, token, 127.0.0.1:1883", "store at mqtt://store-1:7883/x and a@b:c",
             "user alice logged in as alice:secret without a scheme"]
    try:
        setup_logging("info", json_lines=True)
        for line in lines:
            logging.getLogger("x").warning(line, extra={"ctx": {"same": line}})
        docs = [json.loads(text) for text in capsys.readouterr().err.splitlines()]
        assert [(doc["msg"], doc["same"]) for doc in docs] == [(line, line) for line in lines]
    finally:
        setup_logging("info")
