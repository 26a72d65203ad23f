"""The noise node as a child process (``corrflow simulate --secagg --noise-node``): its own
interpreter, its state in its own directory, reached only through a pipe that carries stage
messages' config records — the server's process never holds its key.

`NoiseNodeProcess` starts it (spawned, not forked: nothing of the parent's memory is shared),
restarts it when it died (a new start of the node: its next row opens a new key segment) and
answers the in-process grid's messages to the noise node's id (`NoiseNodeProcess.handler`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from corrflow.run.noise_node_link import NoiseNodeLink

log = logging.getLogger("corrflow")

#: Seconds the parent waits for the child to start, and for one answer.
START_TIMEOUT, CALL_TIMEOUT = 120.0, 120.0


def serve(conn, directory: str) -> None:
    """The child's loop: one request in, one answer out, until the pipe closes."""
    from corrflow.noisenode.node import NoiseNode
    from corrflow.noisenode.store import NoiseNodeStore

    node = NoiseNode(NoiseNodeStore(directory))
    conn.send({"ok": node.identity()})
    while True:
        try:
            req = conn.recv()
        except EOFError:
            return
        try:
            if req["op"] == "pin":
                out = node.pin(req["recipe"], Path(req["factorization"]).read_bytes())
            else:
                out = node.handle(req["stage"], req["config"])
            conn.send({"ok": out})
        except Exception as exc:  # answered, never crashes the node
            conn.send({"error": f"{type(exc).__name__}: {exc}"})


class NoiseNodeError(RuntimeError):
    """The noise node refused a request or could not be reached."""


class NoiseNodeProcess:
    """The noise node's child process over ``directory`` (module docstring)."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self._proc = None
        self._conn = None
        self.identity: dict = {}

    def start(self) -> dict:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child, str(self.dir)), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(START_TIMEOUT):
            self.close()
            raise NoiseNodeError(f"the noise node in {self.dir} did not start")
        self.identity = self._answer(parent.recv())
        return self.identity

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def call(self, request: dict, timeout: float = CALL_TIMEOUT):
        """One request's answer.

        Raises:
            NoiseNodeError: the node refused (its reason), or died or did not answer.
        """
        if not self.alive():
            raise ConnectionError("the noise node is not running")
        try:
            self._conn.send(request)
            if not self._conn.poll(timeout):
                raise ConnectionError("the noise node did not answer")
            return self._answer(self._conn.recv())
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise ConnectionError(f"the noise node died ({type(exc).__name__})") from exc

    @staticmethod
    def _answer(reply: dict):
        if "error" in reply:
            raise NoiseNodeError(reply["error"])
        return reply["ok"]

    def pin(self, recipe: dict, factorization: Path) -> float:
        """Pin the run's recipe; returns σ_max."""
        return float(
            self.call({"op": "pin", "recipe": recipe, "factorization": str(factorization)})[
                "sigma_max"
            ]
        )

    def link(self) -> NoiseNodeLink:
        """The server's link to this node, pinning through it."""
        i = self.identity
        return NoiseNodeLink(
            int(i["node_id"]), i["public_key"], i["signature"], pin=lambda r, f: self.pin(r, f)
        )

    def handler(self, msg: Message, ctxt: Context) -> Message:
        """The in-process grid's handler for the noise node's id: a SecAgg+ stage message goes to
        the child; a dead child is started again at the next setup (the round that lost it fails
        and is redone)."""
        config = dict(msg.content.config_records[RECORD_KEY_CONFIGS])
        stage = config.pop(Key.STAGE)
        if not self.alive() and stage == "setup":
            log.warning("the noise node had stopped; starting it again from %s", self.dir)
            self.start()
        try:
            out = self.call({"op": "stage", "stage": stage, "config": config})
        except ConnectionError as exc:
            return Message(Error(code=5, reason=f"Node Unavailable: {exc}"), reply_to=msg)
        return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(out)}), reply_to=msg)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._proc = self._conn = None
