"""The engine rig's ports: distinct when picked together, and a port that another process took in the meantime
(a ZeroMQ socket answering the health check with its binary greeting) is told apart from a slow start, so the
server is started again on new ports instead of failing a 30-minute bench."""
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvcx.integrations import engine_local as el


def test_ports_picked_together_are_distinct():
    for _ in range(20):
        ports = el.free_ports(4)
        assert len(set(ports)) == 4 and all(1024 <= p < 65536 for p in ports)


def test_a_non_http_answer_is_a_taken_port(tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def zmq_like():
        c, _ = srv.accept()
        c.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f")     # ZMTP's greeting, then it hangs up
        c.recv(1000)
        c.shutdown(socket.SHUT_WR)
        time.sleep(1)
        c.close()

    threading.Thread(target=zmq_like, daemon=True).start()
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    server = el.Server("test server", proc, srv.getsockname()[1], Path(tmp_path / "log"), {})
    with pytest.raises(el.PortTaken, match="answered as something other than test server"):
        el._wait_http(server, "/health", 10)
    assert not server.alive()       # the process started on the taken port is stopped
    srv.close()


def test_a_taken_port_is_retried_on_new_ports_unless_fixed():
    calls = []

    def start():
        calls.append(1)
        if len(calls) < el.START_ATTEMPTS:
            raise el.PortTaken("taken")
        return "server"

    assert el._retry_on_taken_port(start, 0) == "server" and len(calls) == el.START_ATTEMPTS
    calls.clear()
    with pytest.raises(el.PortTaken):
        el._retry_on_taken_port(start, 12345)       # the caller's own port: not changed behind its back
    assert len(calls) == 1
