"""OpenAI's official Python client against layerwise servers, called as a new user would.

Usage: openai_check.py DIT_URL DIT_MODEL WAN_URL WAN_MODEL QWEN_URL QWEN_MODEL OUT_DIR

Images from a class-conditional DiT server (a prompt naming an ImageNet class, or an empty
prompt beside `class_label`), from a text-to-video Wan server and from a text-to-image
Qwen-Image server (two at once, guided by a negative prompt); the whole video flow on the
Wan server (create, poll, download the MP4 and its thumbnail, list, delete); and OpenAI's
image fields this server has no knob for, each sent alone and all together (200s, the
ignored ones named in x-ignored-fields). Writes the MP4
and a JSON summary under OUT_DIR for the caller to check; exits non-zero on the first
failure, with what failed.
"""

import base64
import json
import sys
import warnings
from pathlib import Path

import openai
from openai import OpenAI

# The client marks its video calls deprecated (the hosted API's shutdown); they still work.
warnings.simplefilter("ignore", DeprecationWarning)


def client(url):
    return OpenAI(base_url=url + "/v1", api_key="not-checked", max_retries=0, timeout=120)


def expect_error(kind, call):
    try:
        call()
    except kind as e:
        return e
    raise AssertionError(f"expected {kind.__name__}")


# OpenAI's image fields this server has no knob for, each as OpenAI's client sends it: each
# alone gets a 200, and the ones ignored come back named in x-ignored-fields.
OPENAI_FIELDS = [
    ("quality", "high", True),
    ("style", "vivid", True),
    ("complexity", "low", True),
    ("moderation", "low", True),
    ("output_compression", 100, True),
    ("partial_images", 0, True),
    ("user", "check-user", False),
    ("safety_identifier", "check-id", False),
    ("output_format", "png", False),
    ("background", "opaque", False),
    ("stream", False, False),
    ("size", "auto", False),
]


def check_openai_fields(dit, dit_model):
    for name, value, ignored in OPENAI_FIELDS:
        raw = dit.images.with_raw_response.generate(
            model=dit_model, prompt="goldfish", **{name: value}, extra_body={"steps": 1})
        assert raw.http_response.status_code == 200, (name, raw.http_response.status_code)
        header = raw.headers.get("x-ignored-fields")
        assert header == (name if ignored else None), (name, header)
        assert base64.b64decode(raw.parse().data[0].b64_json)[1:4] == b"PNG", name
    everything = {name: value for name, value, _ in OPENAI_FIELDS}
    raw = dit.images.with_raw_response.generate(model=dit_model, prompt="goldfish", **everything,
                                                extra_body={"steps": 1})
    assert raw.headers["x-ignored-fields"] == ", ".join(n for n, _, i in OPENAI_FIELDS if i), raw.headers
    e = expect_error(openai.UnprocessableEntityError,
                     lambda: dit.images.generate(model=dit_model, prompt="goldfish",
                                                 output_format="jpeg"))
    assert "output_format" in str(e), e
    e = expect_error(openai.UnprocessableEntityError,
                     lambda: dit.images.generate(model=dit_model, prompt="goldfish",
                                                 extra_body={"sharpness": 3}))
    assert "sharpness" in str(e), e


def main():
    dit_url, dit_model, wan_url, wan_model, qwen_url, qwen_model, out = sys.argv[1:8]
    out = Path(out)
    summary = {}

    dit = client(dit_url)
    assert [m.id for m in dit.models.list().data] == [dit_model]
    assert dit.models.retrieve(dit_model).id == dit_model
    named = dit.images.generate(model=dit_model, prompt="goldfish", size="64x64",
                                extra_body={"steps": 2, "seed": 5})
    png = base64.b64decode(named.data[0].b64_json)
    assert png[1:4] == b"PNG", png[:8]
    by_label = dit.images.generate(model=dit_model, prompt="", size="64x64",
                                   extra_body={"class_label": 1, "steps": 2, "seed": 5})
    assert by_label.data[0].b64_json == named.data[0].b64_json, "goldfish is class 1"
    e = expect_error(openai.NotFoundError,
                     lambda: dit.images.generate(model="dall-e-3", prompt="goldfish"))
    assert dit_model in str(e), e
    e = expect_error(openai.UnprocessableEntityError,
                     lambda: dit.images.generate(model=dit_model, prompt="a cat on a mat"))
    assert "prompt" in str(e), e
    e = expect_error(openai.UnprocessableEntityError,
                     lambda: dit.videos.create(model=dit_model, prompt="goldfish"))
    summary["dit_png_bytes"] = len(png)
    check_openai_fields(dit, dit_model)

    wan = client(wan_url)
    assert [m.id for m in wan.models.list().data] == [wan_model]
    img = wan.images.generate(model=wan_model, prompt="a red kite over a beach", size="32x32",
                              extra_body={"steps": 2, "negative_prompt": "blurry"})
    assert base64.b64decode(img.data[0].b64_json)[1:4] == b"PNG"

    video = wan.videos.create(model=wan_model, prompt="a red fox running through fresh snow",
                              seconds="1", size="48x32",
                              extra_body={"fps": 8, "steps": 3, "negative_prompt": "static",
                                          "guidance_2": 3.0, "seed": 2, "user": "check-user"})
    assert video.status in ("queued", "in_progress"), video
    assert video.size == "48x32" and video.model == wan_model, video
    done = wan.videos.poll(video.id, poll_interval_ms=20)
    assert done.status == "completed" and done.progress == 100, done
    mp4 = wan.videos.download_content(video.id).read()
    (out / "video.mp4").write_bytes(mp4)
    thumb = wan.videos.download_content(video.id, variant="thumbnail").read()
    assert thumb[1:4] == b"PNG"
    assert video.id in [v.id for v in wan.videos.list(limit=10)]
    again = wan.videos.create_and_poll(model=wan_model, prompt="waves at dusk", seconds="1",
                                       size="32x32", poll_interval_ms=20,
                                       extra_body={"fps": 4, "steps": 2})
    assert again.status == "completed", again
    gone = wan.videos.delete(again.id)
    assert gone.deleted and gone.id == again.id, gone
    e = expect_error(openai.NotFoundError,
                     lambda: wan.videos.create(model="sora-2", prompt="x", size="32x32"))
    e = expect_error(openai.UnprocessableEntityError,
                     lambda: wan.videos.create(model=wan_model, prompt="x", seconds="12",
                                               size="32x32"))
    assert "seconds" in str(e), e
    qwen = client(qwen_url)
    assert [m.id for m in qwen.models.list().data] == [qwen_model]
    images = qwen.images.generate(model=qwen_model, prompt="a red fox in the snow", n=2,
                                  size="64x48", response_format="b64_json",
                                  extra_body={"steps": 2, "seed": 3, "negative_prompt": "blurry"})
    pngs = [base64.b64decode(d.b64_json) for d in images.data]
    for png in pngs:
        assert png[1:4] == b"PNG", png[:8]
        assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (64, 48)
    assert pngs[0] != pngs[1], "two images of one request differ"
    e = expect_error(openai.UnprocessableEntityError,
                     lambda: qwen.images.generate(model=qwen_model, prompt="a fox", size="40x40"))
    assert "size" in str(e), e
    e = expect_error(openai.APIStatusError,
                     lambda: qwen.videos.create(model=qwen_model, prompt="a fox", size="32x32"))
    assert 400 <= e.status_code < 500, e
    summary["qwen_image_png_bytes"] = [len(p) for p in pngs]

    summary.update(video_id=video.id, seconds=done.seconds, frames=done.model_extra["frames"],
                   mp4_bytes=len(mp4), thumbnail_bytes=len(thumb))
    (out / "summary.json").write_text(json.dumps(summary))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
