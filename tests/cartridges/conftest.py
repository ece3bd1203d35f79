import contextlib
import socket
import threading
import time

import pytest


@pytest.fixture(scope="session")
def serve_app():
    """`serve_app(app, **uvicorn options)`: a context manager that runs the real uvicorn server (with the
    connection timeouts of `cartridges.http.uvicorn_config`) in a thread on a free loopback port and yields its
    base URL."""
    pytest.importorskip("uvicorn")
    import uvicorn

    from cartridges.http import uvicorn_config

    @contextlib.contextmanager
    def serve(app, **options):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn_config(app, log_level="warning", lifespan="on", **options))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.time() + 20
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(10)
            sock.close()

    return serve
