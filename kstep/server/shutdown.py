"""How `kstep serve` stops (SIGTERM, Ctrl-C): uvicorn, with the in-flight generations ended first.

uvicorn alone waits for open requests up to its grace period and then cancels their tasks (a
traceback per request): a generation may run for minutes, so every shutdown would wait the whole
period. Here a shutdown first refuses new requests (503), lets the running ones go on for the
drain time asked for (`--graceful-timeout`, default none), then ends every one still queued or
running with a 503 naming the shutdown (a stream: an error event), so uvicorn finds its
connections finishing and exits at once."""
import asyncio
import logging
import socket
import time

import uvicorn

FLUSH_SECONDS = 5.0  # for uvicorn, once the generations have ended: responses still being written out


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_seconds: float = 0.0):
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self.failed = False  # a model could not run any more: the server stopped itself (exit 1)

    def stop_failed(self) -> None:
        self.failed = self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        routes = self.config.app.state.routes
        routes.refuse_new()
        deadline = time.monotonic() + self.drain_seconds
        while routes.num_in_flight() and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        routes.end_in_flight()
        await super().shutdown(sockets)


def serve(app, host: str, port: int, log_level: str, drain_seconds: float) -> int:
    """Run `app` (build_app's) until a signal stops it, or until none of its models can run any
    more (each lost a tensor-parallel rank: one down alone leaves the others serving); the exit
    code: 0, or 1 for the latter."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_SECONDS)
    server = Server(config, drain_seconds)
    app.state.routes.on_no_live_model = server.stop_failed
    server.run()
    if server.failed:
        logging.getLogger("kstep.engine").error("kstep serve stopped: none of its models can run any more")
    return 1 if server.failed else 0
