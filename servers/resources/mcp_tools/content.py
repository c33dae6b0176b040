"""An MCP tool result as the output a model reads.

Text content passes through and an image block becomes an image part (the
output is then content parts, gym_grpc/images.py). Other content is named in
brackets, never dropped without a word: an audio block becomes `[audio/wav
audio, 10240 bytes base64, not shown]` (and so does an image block whose data
is not an image gym-grpc takes, with the reason), an embedded resource its
text (or the same bracket for a binary one), a resource link `[resource link:
URI]`. A result with no content but structured content gives that as JSON.
Text blocks are joined by newlines.
"""

from __future__ import annotations

import base64
import binascii
import json

from mcp.types import (
    AudioContent,
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)

from gym_grpc import errors
from gym_grpc.images import Image
from gym_grpc.responses import input_text_part
from gym_grpc.v1 import responses_pb2 as r


def _not_shown(kind: str, mime_type: str | None, data: str) -> str:
    return f"[{mime_type or 'unknown type'} {kind}, {len(data)} bytes base64, not shown]"


def block_text(block: object) -> str:
    """One content block as text."""
    if isinstance(block, TextContent):
        return block.text
    if isinstance(block, ImageContent):
        return _not_shown("image", block.mime_type, block.data)
    if isinstance(block, AudioContent):
        return _not_shown("audio", block.mime_type, block.data)
    if isinstance(block, EmbeddedResource):
        resource = block.resource
        if isinstance(resource, TextResourceContents):
            return resource.text
        if isinstance(resource, BlobResourceContents):
            return _not_shown(f"resource {resource.uri}", resource.mime_type, resource.blob)
    if isinstance(block, ResourceLink):
        return f"[resource link: {block.uri}]"
    kind = getattr(block, "type", type(block).__name__)
    return f"[{kind} content, not shown]"


def result_output(result: CallToolResult) -> str | list[r.ContentPart]:
    """A tool result as text, or as content parts when it holds an image."""
    if not any(isinstance(block, ImageContent) for block in result.content):
        return result_text(result)
    return [_image_part(b) if isinstance(b, ImageContent) else input_text_part(block_text(b)) for b in result.content]


def _image_part(block: ImageContent) -> r.ContentPart:
    try:
        return Image.from_bytes(base64.b64decode(block.data, validate=True)).part()
    except (binascii.Error, ValueError, errors.GymError) as e:
        why = e.message if isinstance(e, errors.GymError) else f"not base64: {e}"
        return input_text_part(f"{_not_shown('image', block.mime_type, block.data)[:-1]}: {why}]")


def result_text(result: CallToolResult) -> str:
    """A tool result's content as one text."""
    parts = [block_text(block) for block in result.content]
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)
