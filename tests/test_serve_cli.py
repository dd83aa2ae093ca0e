"""The command side of serve and the CLI: --chat-template, the access log's secrets, a closed pipe."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from moeswarm.bundled import TRAINED
from moeswarm.errors import MoeSwarmError
from moeswarm.serve.chat import CHATML, read_chat_template
from moeswarm.serve.http_limits import RedactSecrets


def test_chat_template_by_name_by_file_and_refused(tmp_path):
    assert read_chat_template("chatml") == CHATML
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert read_chat_template(str(good)) == good.read_text()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(MoeSwarmError, match="not a Jinja template"):
        read_chat_template(str(bad))
    with pytest.raises(MoeSwarmError, match=r"neither a file nor a named template \(chatml\)"):
        read_chat_template(str(tmp_path / "missing"))


def test_serve_refuses_a_bad_chat_template_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "moeswarm.cli", "serve", "--model", str(TRAINED), "--port", "0",
                           "--chat-template", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == \
        f"moeswarm serve: error: --chat-template '{tmp_path / 'missing'}' is neither a file nor a named template (chatml)"


def test_the_access_log_never_shows_a_key():
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5000", "GET", "/?key=sk-secret&x=1", "1.1", 200), None)
    assert RedactSecrets().filter(record)
    assert record.getMessage() == '127.0.0.1:5000 - "GET /?key=REDACTED&x=1 HTTP/1.1" 200'
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "GET /v1/x?api_key=abc&token=t", (), None)
    RedactSecrets().filter(record)
    assert "abc" not in record.getMessage() and "=t" not in record.getMessage()


def test_a_closed_pipe_ends_the_command_without_a_traceback():
    child = subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "info", str(TRAINED)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    child.stdout.close()  # the reader is gone before the first line: `moeswarm info M | head -0`
    _, err = child.communicate(timeout=120)
    assert child.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err
