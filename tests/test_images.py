"""Images in rollouts (gym_grpc/images.py): tool outputs with images, each image sent to the model
server once and named by its hash after, rows that hold it once, and the errors for a bad one."""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from gym_grpc import errors, images
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.vllm_model import chat
from gym_grpc.client.stubs import AgentClient, ModelClient
from gym_grpc.data import rows
from gym_grpc.images import Image, ImageStore
from gym_grpc.resources import ResourcesServer, Session, Verification, tool
from gym_grpc.responses import final_text, user_message
from gym_grpc.rpc.registry import Registry
from gym_grpc.testing import ScriptedModel, call, say
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2
from tests.corpus import nemo_gym_lines


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A real PNG of one colour (zlib and struct, as the format says)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows_ = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows_)) + chunk(b"IEND", b"")


RED, BLUE = png(64, 48, (255, 0, 0)), png(64, 48, (0, 0, 255))


class Screens(ResourcesServer):
    """A screen that is red until `press` turns it blue; `screenshot` shows it, `look` says and shows it."""

    async def seed_session(self, session: Session) -> None:
        session.state["screen"] = RED

    @tool
    async def screenshot(self, session: Session) -> Image:
        """The screen."""
        return Image.from_bytes(session.state["screen"])

    @tool
    async def look(self, session: Session) -> list:
        """The screen, said and shown."""
        colour = "red" if session.state["screen"] == RED else "blue"
        return [f"The screen is {colour}.", Image.from_bytes(session.state["screen"]), {"pixels": 64 * 48}]

    @tool
    async def press(self, session: Session) -> str:
        """Turn the screen blue."""
        session.state["screen"] = BLUE
        return "pressed"

    async def verify(self, session: Session, response: r.Response) -> Verification:
        shown = [i for _, i in images.images_in(response.output)]
        return Verification(
            reward=1.0 if session.state.get("screen") == BLUE and "done" in final_text(response) else 0.0,
            fields={"pictures": len(shown), "with_bytes": sum(1 for i in shown if i.data)},
        )


class _Recording(ImageStore):
    """The store of a model server that also notes what each call carried: hashes by value, and references."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[str], list[str]]] = []

    def resolve(self, params: r.CreateParams, session_id: str) -> None:
        found = [image for _, image in images.images_in(params.input_items.items)]
        by_value = [images.Image(i.data, i.media_type).sha256 for i in found if i.data]
        self.calls.append((by_value, [i.sha256 for i in found if not i.data]))
        super().resolve(params, session_id)


def _task(text: str = "Make the screen blue, then say done.") -> task_pb2.Task:
    task = task_pb2.Task()
    params = task.responses_create_params
    params.input_items.items.append(user_message(text))
    for spec in Screens.tools.values():
        params.tools.add().function.CopyFrom(spec.schema)
    return task


async def _stack(start, model: ScriptedModel) -> AgentClient:
    policy, env = await start(model), await start(Screens())
    static = {"policy": policy.address, "screens": env.address}
    config = {"model_server": "policy", "resources_server": "screens", "max_steps": 8}
    agent = await start(SimpleAgent(config, name="agent", registry=Registry(static=static)))
    return AgentClient(Registry(static={**static, "agent": agent.address}), "agent")


SCRIPT = [
    [call("screenshot", "{}")],
    [call("screenshot", "{}")],  # the same picture again
    [call("press", "{}")],
    [call("look", "{}")],
    say("done"),
]
RED_HASH, BLUE_HASH = Image(RED, "image/png").sha256, Image(BLUE, "image/png").sha256


async def test_each_image_goes_to_the_model_server_once_and_the_model_sees_every_one(start):
    model = ScriptedModel(SCRIPT)
    model.images = store = _Recording()
    agent = await _stack(start, model)
    rollout = await agent.run(_task())
    assert rollout.reward == 1.0
    # What travelled: each picture by value in the first call that held it, by its hash in every later one.
    assert [by_value for by_value, _ in store.calls] == [[], [RED_HASH], [], [], [BLUE_HASH]]
    assert [refs for _, refs in store.calls] == [[], [], [RED_HASH] * 2, [RED_HASH] * 2, [RED_HASH] * 2]
    # What the model server's own code saw: every picture's bytes, in every call.
    last = [(i.data, i.media_type) for _, i in images.images_in(model.requests[-1].input_items.items)]
    assert last == [(RED, "image/png"), (RED, "image/png"), (BLUE, "image/png")]
    look = [i.function_call_output.output_parts.items for i in model.requests[-1].input_items.items][-1]
    assert [p.WhichOneof("part") for p in look] == ["input_text", "input_image", "input_text"]
    assert (look[0].input_text.text, look[2].input_text.text) == ("The screen is blue.", '{"pixels": 3072}')


async def test_verify_names_the_tools_images_by_hash_and_the_verifier_sees_their_bytes(start):
    agent = await _stack(start, ScriptedModel(SCRIPT))
    rollout = await agent.run(_task())
    assert rows.json_field(rollout, "verifier_fields") == {"pictures": 3, "with_bytes": 3}
    sent = images.tool_images_as_references(rollout.response)
    assert [bool(i.data) for _, i in images.images_in(sent.output)] == [False] * 3
    assert [bool(i.data) for _, i in images.images_in(rollout.response.output)] == [True, False, True]  # untouched


async def test_a_rollout_row_holds_each_image_once_and_loads_back_equal(start):
    agent = await _stack(start, ScriptedModel(SCRIPT))
    rollout = await agent.run(_task())
    row = rows.response_to_json(rollout.response)
    urls = [
        part["image_url"]
        for item in row["output"]
        if item["type"] == "function_call_output" and isinstance(item["output"], list)
        for part in item["output"]
        if part["type"] == "input_image"
    ]
    assert [u[:22] for u in urls] == ["data:image/png;base64,", "sha256:" + RED_HASH[:15], "data:image/png;base64,"]
    assert urls[1] == f"sha256:{RED_HASH}"
    assert rows.response_to_json(rows.response_from_json(row)) == row
    texts = [
        item["output"][0] for item in row["output"] if item.get("call_id") and isinstance(item.get("output"), list)
    ]
    assert {"type": "input_text", "text": "The screen is blue."} in texts


async def test_a_model_server_that_forgot_the_images_is_sent_them_again_by_value(start):
    def forget(params: r.CreateParams) -> r.Response:
        ImageStore.__init__(model.images)  # as after a restart: nothing kept
        return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=[call("press", "{}")])

    model = ScriptedModel([SCRIPT[0], forget, SCRIPT[3], SCRIPT[4]])
    model.images = store = _Recording()
    agent = await _stack(start, model)
    rollout = await agent.run(_task())
    assert rollout.reward == 1.0
    # Call 3 named the red picture, which the server had forgotten: IMAGE_NOT_FOUND, then again by value.
    assert [by_value for by_value, _ in store.calls] == [[], [RED_HASH], [], [RED_HASH], [BLUE_HASH]]


async def test_an_image_never_sent_is_image_not_found_and_a_bad_one_image_invalid(start):
    running = await start(ScriptedModel([say("hi")]))
    model = ModelClient(Registry(static={"model": running.address}), "model")

    def request(image: r.InputImage) -> model_pb.CreateResponseRequest:
        item = r.Item(
            message=r.Message(role=r.ROLE_USER, parts=r.ContentList(items=[r.ContentPart(input_image=image)]))
        )
        req = model_pb.CreateResponseRequest(session_id="s")
        req.params.input_items.items.extend([user_message("look"), item])
        return req

    with pytest.raises(errors.FailedPrecondition) as lost:
        await model.send(request(r.InputImage(sha256=RED_HASH)))
    assert lost.value.reason == errors.Reason.IMAGE_NOT_FOUND and "params.input_items.items[1]" in lost.value.message
    with pytest.raises(errors.InvalidArgument) as bad:
        await model.send(request(r.InputImage(data=b"GIF? no, text", media_type="image/gif")))
    assert bad.value.reason == errors.Reason.IMAGE_INVALID and "not a PNG, JPEG, GIF or WebP image" in bad.value.message
    with pytest.raises(errors.InvalidArgument) as lying:
        await model.send(request(r.InputImage(data=RED, media_type="image/png", sha256=BLUE_HASH)))
    assert "is not the hash of the image's bytes" in lying.value.message
    await model.send(request(r.InputImage(data=RED, media_type="image/png")))  # sent once: then known by its hash
    await model.send(request(r.InputImage(sha256=RED_HASH)))
    await model.registry.close()


def test_a_tool_image_too_large_or_not_an_image_is_refused_naming_it():
    with pytest.raises(errors.InvalidArgument, match="over the limit of 1,000") as large:
        images.check(RED + b"\0" * 1000, "screenshot", limit=1000)
    assert large.value.reason == errors.Reason.IMAGE_INVALID and large.value.field == "screenshot"
    with pytest.raises(errors.InvalidArgument, match=r"image: 5 bytes that are not .* \(they begin b'hello'\)"):
        Image.from_bytes(b"hello")
    jpeg, gif, webp = b"\xff\xd8\xff\xe0rest", b"GIF89a...", b"RIFF\x10\0\0\0WEBPVP8 "
    assert [images.media_type_of(x) for x in (jpeg, gif, webp)] == ["image/jpeg", "image/gif", "image/webp"]


def test_a_data_url_loads_as_bytes_and_a_non_canonical_one_stays_a_url():
    url = images.to_url(r.InputImage(data=RED, media_type="image/png"))
    part = rows.item_from_json({"role": "user", "content": [{"type": "input_image", "image_url": url}]})
    image = part.message.parts.items[0].input_image
    assert (image.data, image.media_type, image.image_url) == (RED, "image/png", "")
    for kept in (url[:-4] + "\n" + url[-4:], "https://example.com/a.png", "sha256:abc", "data:text/plain;base64,aGk="):
        item = {"role": "user", "content": [{"type": "input_image", "image_url": kept, "detail": "low"}]}
        loaded = rows.item_from_json(item)
        assert loaded.message.parts.items[0].input_image.image_url == kept
        assert rows.item_to_json(loaded)["content"] == item["content"]


def test_the_chat_form_shows_a_tools_images_in_a_user_message_after_its_text():
    params = r.CreateParams()
    output = r.FunctionCallOutput(call_id="c1")
    output.output_parts.items.extend(
        [Image(RED, "image/png").part(), r.ContentPart(input_text=r.InputText(text="red"))]
    )
    params.input_items.items.extend([user_message("look"), call("look", "{}"), r.Item(function_call_output=output)])
    messages = chat.to_messages(params, ("<think>", "</think>"))
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "red"}
    assert messages[3] == {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": images.to_url(output.output_parts.items[0].input_image)}}
        ],
    }


def test_nemo_gyms_image_rows_load_with_their_pictures_as_bytes():
    """NeMo Gym 0.7.0's own rows with images (circle_click, image_tools, vlm_eval_kit...): every data URL
    is a real image, loaded as bytes; that the rows come back equal is test_fidelity's."""
    loaded = 0
    for name, _, line in nemo_gym_lines("example.jsonl"):
        if b"data:image" not in line:
            continue
        params = rows.task_from_row(json.loads(line)).responses_create_params
        found = [image for _, image in images.images_in(params.input_items.items)]
        assert found and all(images.media_type_of(i.data) == i.media_type for i in found), name
        loaded += len(found)
    assert loaded >= 25
