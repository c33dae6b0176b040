"""A browser environment: web tasks in headless Chromium, seen through screenshots, done with the mouse
and keyboard, scored from the page's own state.

One Chromium per server process (Debian's `chromium`, driven over the DevTools protocol by Playwright:
no browser is downloaded), a browser context of its own per session (its own cookies, storage and
page), opened at SeedSession on the task's page and closed at CloseSession. `max_browsers` caps the
contexts alive: a session beyond it waits for one, within its call's deadline, so the cap holds for
every collector and trainer using the server. Tasks are local HTML pages (tasks/*.html) in the spirit
of MiniWoB; each page says in `window.reward()` whether its task is done (1) or not (0), and verify
asks it. docs/browser.md says how to add one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from pydantic import Field

from gym_grpc import errors
from gym_grpc.images import Image
from gym_grpc.resources import ResourcesConfig, ResourcesServer, Session, Verification, tool
from gym_grpc.rpc import transport
from gym_grpc.v1 import responses_pb2 as r

from . import tasks

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
#: Chromium's flags for a closed machine: no first-run, sync, component updates or background fetches
#: (on a machine without network those are refused, many at a time), no GPU.
CHROMIUM_FLAGS = [
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
#: The keys `key` accepts besides single characters (Playwright's names).
KEYS = {
    "Enter", "Tab", "Escape", "Backspace", "Delete", "Home", "End", "PageUp", "PageDown",
    "ArrowLeft", "ArrowRight", "ArrowUp", "ArrowDown", "Space",
}  # fmt: skip


class BrowserConfig(ResourcesConfig):
    tasks_dir: str = Field(str(HERE / "tasks"), description="the folder of the task pages (NAME.html) rows name")
    chromium: str = Field("", description="the Chromium executable; empty: chromium or chromium-browser on PATH")
    max_browsers: int = Field(16, ge=1, description="browser contexts alive at once; more sessions wait for one")
    width: int = Field(400, ge=64, le=4096, description="the page's width in pixels (the screenshots' too)")
    height: int = Field(300, ge=64, le=4096, description="the page's height in pixels")
    action_timeout_seconds: float = Field(10.0, gt=0, description="how long one action may take")
    screenshot_after_action: bool = Field(
        False, description="each action's output ends with a screenshot of the page after it (computer-use style)"
    )


def find_chromium(configured: str = "") -> str:
    """The Chromium executable to drive: the configured one, else chromium or chromium-browser on PATH."""
    for name in [configured] if configured else ["chromium", "chromium-browser"]:
        found = shutil.which(name)
        if found:
            return found
    wanted = repr(configured) if configured else "chromium (or chromium-browser) on PATH"
    raise errors.ConfigError(
        f"the browser environment needs Chromium: {wanted} was not found. Install Debian's package "
        "(apt-get install chromium) or set `chromium:` to its path"
    )


class BrowserEnv(ResourcesServer):
    Config = BrowserConfig
    config: BrowserConfig
    verifier_fields = {"task": "the task page's name", "actions": "mouse and keyboard actions the session took"}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tasks_dir = Path(self.config.tasks_dir).resolve()
        if not self.tasks_dir.is_dir():
            raise errors.ConfigError(f"tasks_dir {self.tasks_dir} is not a folder")
        self.executable = ""  # found at start: a server that is only described needs no browser
        self.slots = asyncio.Semaphore(self.config.max_browsers)
        self.waiting = 0
        self._playwright: Any = None
        self._browser: Any = None
        self._launching = asyncio.Lock()

    async def _browser_running(self) -> Any:
        """The server's Chromium, launched at first use (a server that serves no session starts none)."""
        async with self._launching:
            if self._browser is None or not self._browser.is_connected():
                from playwright.async_api import async_playwright

                if self._playwright is None:
                    self._playwright = await async_playwright().start()
                self._browser = await self._playwright.chromium.launch(
                    executable_path=self.executable, headless=True, args=CHROMIUM_FLAGS, chromium_sandbox=False
                )
                log.info("Chromium %s started (%s)", self._browser.version, self.executable)
            return self._browser

    async def start(self) -> None:
        await super().start()
        self.executable = find_chromium(self.config.chromium)

    async def stop(self) -> None:
        try:
            await super().stop()  # closes every session's context first
        finally:
            if self._browser is not None:
                await self._browser.close()
            if self._playwright is not None:
                await self._playwright.stop()

    def task_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        return tasks.task_rows(self.tool_definitions(), self.tasks_dir, self.config.width, self.config.height)[:limit]

    # --- sessions ---------------------------------------------------------------

    def _page_of(self, name: Any) -> Path:
        if not isinstance(name, str) or not name:
            raise errors.TaskDataError("task", "is required: the name of a task page (tasks/NAME.html)")
        page = (self.tasks_dir / f"{name}.html").resolve()
        if page.parent != self.tasks_dir or not page.is_file():
            raise errors.TaskDataError("task", f"{name!r} is not a task page in {self.tasks_dir}")
        return page

    async def seed_session(self, session: Session) -> None:
        page_file = self._page_of(session.data.get("task"))
        await self._take_slot()
        try:
            browser = await self._browser_running()
            context = await browser.new_context(
                viewport={"width": self.config.width, "height": self.config.height}, device_scale_factor=1
            )
            context.set_default_timeout(self.config.action_timeout_seconds * 1000)
            session.state["context"] = context
            page = await context.new_page()
            await page.goto(page_file.as_uri())
            session.state.update(page=page, actions=0)
        except BaseException:
            await self.close_session(session)
            raise

    async def _take_slot(self) -> None:
        """A browser slot, waited for within the call's deadline (queued, not refused)."""
        self.waiting += 1
        try:
            await asyncio.wait_for(self.slots.acquire(), transport.timeout_for(None))
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"no browser within the call's deadline: all {self.config.max_browsers} (max_browsers) in use, "
                f"{self.waiting} sessions waiting"
            ) from None
        finally:
            self.waiting -= 1

    async def close_session(self, session: Session) -> None:
        context = session.state.pop("context", None)
        session.state.pop("page", None)
        if context is None:
            return
        try:
            await context.close()
        except Exception as e:  # a browser that died took its contexts with it
            log.warning("closing the browser context of session %r: %s", session.id, e)
        finally:
            self.slots.release()

    def _page(self, session: Session) -> Any:
        page = session.state.get("page")
        if page is None:
            raise errors.FailedPrecondition(
                f"session {session.id!r} has no page", reason=errors.Reason.SESSION_NOT_OPEN
            )
        return page

    def _inside(self, x: int, y: int) -> None:
        if not (0 <= x < self.config.width and 0 <= y < self.config.height):
            raise ValueError(f"({x}, {y}) is outside the {self.config.width}x{self.config.height} screen")

    async def _acted(self, session: Session, what: str) -> str | list[str | Image]:
        """An action's output: what it did, and the screen after it when `screenshot_after_action`."""
        session.state["actions"] += 1
        if not self.config.screenshot_after_action:
            return what
        return [what, await self.screenshot(session)]

    # --- tools ---------------------------------------------------------------------

    @tool
    async def screenshot(self, session: Session) -> Image:
        """A screenshot of the page as it is now (PNG)."""
        return Image.from_bytes(await self._page(session).screenshot(type="png"), "screenshot")

    @tool
    async def click(self, x: int, y: int, session: Session) -> str | list[str | Image]:
        """Click with the left mouse button at (x, y), in pixels from the top left of the screenshot."""
        self._inside(x, y)
        await self._page(session).mouse.click(x, y)
        return await self._acted(session, f"clicked at ({x}, {y})")

    @tool
    async def type_text(self, text: str, session: Session) -> str | list[str | Image]:
        """Type text with the keyboard, into whatever has the focus (click a text box first)."""
        await self._page(session).keyboard.type(text)
        return await self._acted(session, f"typed {json.dumps(text)}")

    @tool
    async def key(self, name: str, session: Session, times: int = 1) -> str | list[str | Image]:
        """Press a key `times` times: a character, or Enter, Tab, Escape, Backspace, Delete, Home, End,
        PageUp, PageDown, ArrowLeft, ArrowRight, ArrowUp, ArrowDown, Space."""
        if name not in KEYS and len(name) != 1:
            raise ValueError(f"unknown key {name!r}: a single character, or one of {', '.join(sorted(KEYS))}")
        if not 1 <= times <= 100:
            raise ValueError(f"times must be between 1 and 100, not {times}")
        keyboard = self._page(session).keyboard
        for _ in range(times):
            await keyboard.press(" " if name == "Space" else name)
        return await self._acted(session, f"pressed {name}" + (f" {times} times" if times > 1 else ""))

    @tool
    async def scroll(self, dx: int, dy: int, session: Session) -> str | list[str | Image]:
        """Scroll the page by (dx, dy) pixels (positive dy: down)."""
        page = self._page(session)
        where = await page.evaluate("([dx, dy]) => { window.scrollBy(dx, dy); return [scrollX, scrollY]; }", [dx, dy])
        return await self._acted(session, f"scrolled to ({where[0]}, {where[1]})")

    @tool
    async def drag(self, x1: int, y1: int, x2: int, y2: int, session: Session) -> str | list[str | Image]:
        """Press the left mouse button at (x1, y1), move to (x2, y2) and release it there."""
        self._inside(x1, y1)
        self._inside(x2, y2)
        mouse = self._page(session).mouse
        await mouse.move(x1, y1)
        await mouse.down()
        await mouse.move(x2, y2, steps=8)
        await mouse.up()
        return await self._acted(session, f"dragged from ({x1}, {y1}) to ({x2}, {y2})")

    async def verify(self, session: Session, response: r.Response) -> Verification:
        page = session.state.get("page")  # none: a verify without a session, which did nothing
        reward = 0.0
        if page is not None:
            reward = await page.evaluate("() => (typeof window.reward === 'function' ? Number(window.reward()) : 0)")
        fields = {"task": session.data.get("task"), "actions": session.state.get("actions", 0)}
        return Verification(reward=float(reward), fields=fields)
