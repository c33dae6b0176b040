"""A computer-use environment in one file: the model sees coloured squares through screenshots and clicks
the one the task names (reward 1.0 when its last click hit it). Serve it alone and check it:
`python examples/one_file_screen_env.py`, then `gym-grpc conformance ADDRESS --row examples/one_file_screen_tasks.jsonl`
"""

from __future__ import annotations

import asyncio
import random
import struct
import zlib

from gym_grpc.images import Image
from gym_grpc.resources import ResourcesServer, Session, Verification, tool
from gym_grpc.server.serving import serve_until_signalled
from gym_grpc.v1 import responses_pb2 as r

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 60, 220), "yellow": (240, 210, 40)}
CELL = 40  # pixels; the screen is 2x2 cells


def png(cells: list[str]) -> bytes:
    """The screen as a PNG: a 2x2 grid of coloured cells (zlib and struct, as the PNG format says)."""
    pixel = lambda x, y: bytes(COLOURS[cells[(y // CELL) * 2 + x // CELL]])  # noqa: E731
    raw = b"".join(b"\0" + b"".join(pixel(x, y) for x in range(2 * CELL)) for y in range(2 * CELL))
    chunk = lambda kind, body: struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))  # noqa: E731
    head = chunk(b"IHDR", struct.pack(">IIBBBBB", 2 * CELL, 2 * CELL, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + head + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


class ScreenEnv(ResourcesServer):
    verifier_fields = {"clicked": "the colour of the last square clicked, or null"}

    async def seed_session(self, session: Session) -> None:
        cells = list(COLOURS)
        random.Random(session.data.get("seed", 0)).shuffle(cells)  # the task's seed lays the squares out
        session.state.update(cells=cells, clicked=None)

    @tool
    async def screenshot(self, session: Session) -> Image:
        """The screen (80x80 pixels)."""
        return Image.from_bytes(png(session.state["cells"]))

    @tool
    async def click(self, x: int, y: int, session: Session) -> str:
        """Click at (x, y), in pixels from the top left."""
        if not (0 <= x < 2 * CELL and 0 <= y < 2 * CELL):
            raise ValueError(f"({x}, {y}) is off the 80x80 screen")
        session.state["clicked"] = session.state["cells"][(y // CELL) * 2 + x // CELL]
        return "clicked"

    async def verify(self, session: Session, response: r.Response) -> Verification:
        hit = session.state.get("clicked") == session.data.get("target")
        return Verification(reward=1.0 if hit else 0.0, fields={"clicked": session.state.get("clicked")})


if __name__ == "__main__":
    asyncio.run(serve_until_signalled(ScreenEnv(name="screen"), on_ready=lambda s: print(s.address, flush=True)))
