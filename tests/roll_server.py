"""A replicated HTTP server for the rolling-restart tests (tests/test_rolling.py): serves
`GET /` with its pid on the socket omnid holds for it (fd 3, LISTEN_FDS; every instance
has its own on one address, SO_REUSEPORT), and `GET /health` on a port of its own that it
binds only once it is serving, so a client can tell which instances are up.

  roll_server.py HEALTH_PORT [LOAD_SEC]
LOAD_SEC: how long it "loads a model" before it serves (default 0.3)."""

import http.server
import os
import signal
import socket
import sys
import threading
import time


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = f"{os.getpid()}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class Server(http.server.ThreadingHTTPServer):
    """The shared address's server: its request threads are not daemons, so a request it has
    accepted is answered before the process exits (ThreadingHTTPServer's daemon threads die
    with the interpreter, mid-answer, and the client sees a closed connection)."""

    daemon_threads = False


def main() -> None:
    health_port = int(sys.argv[1])
    time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0.3)
    assert os.environ.get("LISTEN_PID") == str(os.getpid()) and os.environ.get("LISTEN_FDS") == "1"
    main_srv = Server(("127.0.0.1", 0), Handler, bind_and_activate=False)
    main_srv.socket.close()
    main_srv.socket = socket.socket(fileno=3)
    health = http.server.ThreadingHTTPServer(("127.0.0.1", health_port), Handler)
    servers = [main_srv, health]
    threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}) for s in servers]
    for t in threads:
        t.start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    # graceful: the health port closes first (no new work), answers under way finish
    for s in reversed(servers):
        s.shutdown()
    health.server_close()
    main_srv.socket.detach()  # fd 3 is omnid's socket too: it keeps it; ours closes with us
    # the interpreter joins the request threads under way (not daemons) before it exits


if __name__ == "__main__":
    main()
