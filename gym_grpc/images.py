"""Images in rollouts: their bytes on the wire, each sent once to a receiver and referenced after.

An `InputImage` holds an image by value (`data` and `media_type`) or by reference (`sha256`
alone, to an image the same receiver was sent by value earlier in the session). Who does what
(docs/images.md):

- an agent sends each image of a rollout's conversation to its model server once:
  `SentImages.after_call` turns what a call sent by value into references in the
  conversation, and `SentImages.restore` puts the bytes back when the model server
  answers IMAGE_NOT_FOUND (it restarted, or forgot the session);
- a model server resolves references with an `ImageStore` before its create_response
  sees the conversation, so a model server's own code always has the bytes;
- a rollout's response holds each image by value once, at its first showing
  (`by_value_once`); a row is written the same way;
- its Verify names the tools' images by hash (`tool_images_as_references`): the resources
  server that returned them keeps them for the session and fills them in (`fill`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from gym_grpc import errors
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

#: The largest image accepted (bytes, encoded); OpenAI's Responses API takes up to 20 MB per image.
MAX_IMAGE_BYTES = 20 * 2**20
#: What a model server keeps of the sessions' images, across sessions, before it forgets the oldest.
STORE_BYTES = 512 * 2**20

_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
#: A reference as a row writes it in `image_url`.
_REFERENCE = re.compile(r"sha256:([0-9a-f]{64})")
_DATA_URL = re.compile(r"data:(image/[A-Za-z0-9.+-]+);base64,")


def media_type_of(data: bytes) -> str | None:
    """The media type of encoded image bytes by their signature (PNG, JPEG, GIF, WebP), or None."""
    for signature, media_type in _SIGNATURES:
        if data.startswith(signature):
            return media_type
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def check(data: bytes, field: str, limit: int = MAX_IMAGE_BYTES) -> str:
    """The media type of `data`; IMAGE_INVALID naming `field` when it is too large or not an image."""
    if len(data) > limit:
        raise errors.InvalidArgument(
            f"{field}: the image is {len(data):,} bytes, over the limit of {limit:,}",
            field=field,
            reason=errors.Reason.IMAGE_INVALID,
        )
    media_type = media_type_of(data)
    if media_type is None:
        raise errors.InvalidArgument(
            f"{field}: {len(data):,} bytes that are not a PNG, JPEG, GIF or WebP image (they begin {data[:8]!r})",
            field=field,
            reason=errors.Reason.IMAGE_INVALID,
        )
    return media_type


@dataclass(frozen=True)
class Image:
    """An encoded image (PNG, JPEG, GIF or WebP). A tool returns one (or a list of text and
    images) to show the model a picture."""

    data: bytes
    media_type: str

    @classmethod
    def from_bytes(cls, data: bytes, field: str = "image") -> Image:
        """The image of `data`, its type read from its signature; IMAGE_INVALID when it is not one."""
        return cls(data, check(data, field))

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def part(self, detail: str = "") -> r.ContentPart:
        """As an `input_image` content part, by value."""
        return r.ContentPart(
            input_image=r.InputImage(data=self.data, media_type=self.media_type, sha256=self.sha256, detail=detail)
        )


# --- the JSON form (rows.py) ----------------------------------------------------


def from_url(image: r.InputImage) -> None:
    """Move a row's `image_url` into the typed fields when it is one of gym-grpc's forms: a data URL
    whose base64 is canonical (so that writing it back gives the same string) becomes data and
    media_type; "sha256:<hex>" becomes a reference. Anything else stays a URL."""
    url = image.image_url
    if url.startswith("sha256:"):
        if _REFERENCE.fullmatch(url):
            image.sha256, image.image_url = url[7:], ""
        return
    head = _DATA_URL.match(url)
    if head is None:
        return
    encoded = url[head.end() :]
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return
    if base64.b64encode(data).decode("ascii") == encoded:
        image.data, image.media_type, image.image_url = data, head.group(1), ""


def to_url(image: r.InputImage) -> str:
    """The `image_url` a row writes: the URL as given, the data URL of an image by value, or
    "sha256:<hex>" for a reference."""
    if image.data:
        return f"data:{image.media_type};base64,{base64.b64encode(image.data).decode('ascii')}"
    if image.sha256:
        return f"sha256:{image.sha256}"
    return image.image_url


# --- walking a conversation -------------------------------------------------------


def images_in(items: Iterable[r.Item]) -> Iterator[tuple[int, r.InputImage]]:
    """Each image of `items` (in messages and tool outputs) with the index of its item, in order.

    Walked on every model call (ImageStore.resolve), text-only conversations included, so it looks at as
    little as it can: an assistant message holds output text and refusals only (the Responses API has no
    image in a model's own words), and is skipped without reading its parts."""
    for index, item in enumerate(items):
        kind = item.WhichOneof("item")
        if kind == "function_call_output":
            parts = item.function_call_output.output_parts.items
        elif kind == "message" and item.message.role != r.ROLE_ASSISTANT:
            if item.message.WhichOneof("content") != "parts":
                continue
            parts = item.message.parts.items
        else:
            continue
        for part in parts:
            if part.HasField("input_image") and (part.input_image.data or part.input_image.sha256):
                yield index, part.input_image


def has_references(items: Iterable[r.Item]) -> bool:
    return any(not image.data for _, image in images_in(items))


def sha256_of(image: r.InputImage) -> str:
    """The image's hash (its sha256 field, filled in from its bytes when empty)."""
    if not image.sha256:
        image.sha256 = hashlib.sha256(image.data).hexdigest()
    return image.sha256


def _to_reference(image: r.InputImage) -> None:
    sha256_of(image)
    image.ClearField("data")


def by_value_once(items: Iterable[r.Item]) -> None:
    """Keep each image by value at its first showing in `items`, and as a reference at every later one."""
    seen: set[str] = set()
    for _, image in images_in(items):
        if image.data:
            key = sha256_of(image)
            if key in seen:
                _to_reference(image)
            seen.add(key)


class SentImages:
    """An agent's memory of the images it sent a model server in one rollout, by hash."""

    def __init__(self) -> None:
        self._bytes: dict[str, bytes] = {}
        self._checked = 0  # the items before this one hold references only

    def before_call(self, items: Sequence[r.Item]) -> None:
        """Before a model call: an image new in the conversation that was sent already (a screen that
        did not change) goes as a reference; the others are noted (and go by value)."""
        for _, image in images_in(items[self._checked :]):
            if image.data:
                key = sha256_of(image)
                if key in self._bytes:
                    image.ClearField("data")
                else:
                    self._bytes[key] = image.data

    def after_call(self, items: Sequence[r.Item]) -> None:
        """After a model call that succeeded: what it sent by value is the server's now, and goes as
        a reference from the next call on (its bytes kept here in case they must go again)."""
        for _, image in images_in(items[self._checked :]):
            if image.data:
                _to_reference(image)
        self._checked = len(items)

    def restore(self, items: Sequence[r.Item]) -> None:
        """Before sending again to a model server that no longer holds them: every reference by value."""
        fill(items, self._bytes)
        self._checked = 0


def fill(items: Iterable[r.Item], known: Mapping[str, bytes]) -> None:
    """Give each reference in `items` whose image is in `known` (bytes by hash) its bytes."""
    for _, image in images_in(items):
        if not image.data and image.sha256 in known:
            image.data = known[image.sha256]


def _tool_images(items: Iterable[r.Item]) -> Iterator[r.InputImage]:
    for item in items:
        if item.WhichOneof("item") == "function_call_output":
            for part in item.function_call_output.output_parts.items:
                if part.input_image.data:
                    yield part.input_image


def tool_images_as_references(response: r.Response) -> r.Response:
    """`response` with the images of its tool outputs as references, for its Verify: the resources server that
    returned them keeps them (Session.images). A copy when there are any, else `response` itself."""
    if next(_tool_images(response.output), None) is None:
        return response
    copy = r.Response()
    copy.CopyFrom(response)
    for image in list(_tool_images(copy.output)):
        _to_reference(image)
    return copy


def tool_images_to_references(response: r.Response) -> None:
    """The images of `response`'s tool outputs as references, in place: for a durable run's result, whose
    caller has them from the run's checkpoints (`from_checkpoints` fills them in again)."""
    for image in list(_tool_images(response.output)):
        _to_reference(image)


def from_checkpoints(response: r.Response, state: task_pb2.RolloutState | None) -> None:
    """Fill the references of a durable run's result from the tool outputs of the state its checkpoints
    describe, then hold each image by value once again (its first showing)."""
    if state is None:
        return
    known = {
        sha256_of(part.input_image): part.input_image.data
        for turn in state.turns
        for output in turn.tool_outputs
        for part in output.output_parts.items
        if part.input_image.data
    }
    if known:
        fill(response.output, known)
        by_value_once(response.output)


class ImageStore:
    """A model server's images by session, so that a conversation can name an image sent earlier by
    its hash. Bounded in bytes: the sessions used longest ago are forgotten first (a call that
    names a forgotten image fails with IMAGE_NOT_FOUND, and its agent sends it again)."""

    def __init__(self, max_bytes: int = STORE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._sessions: OrderedDict[str, dict[str, bytes]] = OrderedDict()
        self._size = 0

    def resolve(self, params: r.CreateParams, session_id: str) -> None:
        """Check the images `params` carries by value and keep them under `session_id`; fill every
        reference with its bytes, or raise IMAGE_NOT_FOUND."""
        if params.WhichOneof("input") != "input_items":
            return
        found = list(images_in(params.input_items.items))
        if not found:
            return
        kept = self._sessions.get(session_id)
        if kept is None:
            kept = self._sessions[session_id] = {}
        self._sessions.move_to_end(session_id)
        for index, image in found:
            if image.data:
                field = f"params.input_items.items[{index}]"
                media_type = check(image.data, field)
                image.media_type = image.media_type or media_type
                key = hashlib.sha256(image.data).hexdigest()
                if image.sha256 and image.sha256 != key:
                    raise errors.InvalidArgument(
                        f"{field}: sha256 {image.sha256} is not the hash of the image's bytes ({key})",
                        field=field,
                        reason=errors.Reason.IMAGE_INVALID,
                    )
                image.sha256 = key
                if key not in kept:
                    kept[key] = image.data
                    self._size += len(image.data)
            elif image.sha256 in kept:
                image.data = kept[image.sha256]
            else:
                raise errors.FailedPrecondition(
                    f"image sha256:{image.sha256} (params.input_items.items[{index}]) was not sent by value in "
                    f"session {session_id!r} to this server, or it was forgotten: send it again by value",
                    field=f"params.input_items.items[{index}]",
                    reason=errors.Reason.IMAGE_NOT_FOUND,
                )
        while self._size > self.max_bytes and len(self._sessions) > 1:
            _, forgotten = self._sessions.popitem(last=False)
            self._size -= sum(len(data) for data in forgotten.values())
