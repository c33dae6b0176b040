"""The messages a stream has yet to write, filled as items come: both ends of RunMany.

Whatever comes while the previous message is being written goes together in the
next one, so that a busy stream writes a few full messages rather than many small
ones; a message holds items up to about MESSAGE_BYTES, and more go in the one after
(a single larger item goes alone).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

#: Under the 4 MiB that gRPC accepts in a message unless told otherwise.
MESSAGE_BYTES = 2 * 2**20

M = TypeVar("M")


class Outbox(Generic[M]):
    """Messages not written yet, oldest first; the newest fills until it is taken or full."""

    def __init__(self, new_message: Callable[[], M]) -> None:
        self._new_message = new_message
        self._messages: deque[M] = deque()
        self._sizes: deque[int] = deque()  # the bytes of the items in each message
        #: Bytes of the items in messages not taken yet (as `filling` was told them).
        self.size = 0

    def filling(self, size: int = 0) -> M:
        """The message to put an item of `size` bytes in: the newest, or a new one when
        there is none or the item would take it past MESSAGE_BYTES."""
        if not self._messages or self._sizes[-1] + size > MESSAGE_BYTES:
            self._messages.append(self._new_message())
            self._sizes.append(0)
        self._sizes[-1] += size
        self.size += size
        return self._messages[-1]

    def take(self) -> M:
        """The oldest message, to write (IndexError when there is none)."""
        message = self._messages.popleft()
        self.size -= self._sizes.popleft()
        return message

    def __bool__(self) -> bool:
        return bool(self._messages)
