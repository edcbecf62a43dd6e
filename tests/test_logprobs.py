"""Log-probabilities: generated tokens carry the denoiser's at their canvas's last step, prompts the
causal encoder's, a given canvas a read-only pass's; the server returns them in OpenAI's shapes (the
payload lm-eval's local-completions sends, and the chat form through the openai client)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from helpers import generate_steps, load_quiet
from live_server import KEY

import dgemma
from dgemma.generation.engine import DenoiseCall, DoneEvent, EncodeCall, answer, score
from dgemma.generation.programs import canvas_logprobs, prompt_logprobs
from dgemma.runtime.runner import as_runner

KW = dict(max_denoising_steps=4, seed=0, stop_token_ids=[])


@pytest.fixture(scope="module")
def model(moe_ckpt):
    return load_quiet(moe_ckpt[0], dtype="fp32")


def _generate_keeping_last_logits(model, prompt, **kw):
    """Generate one row and keep each canvas's last logits, as the model returned them."""
    runner = as_runner(model)
    loop = generate_steps(runner, prompt, **kw)
    last, reply, result = [], None, None
    while True:
        try:
            item = loop.send(reply)
        except StopIteration:
            break
        reply = None
        if isinstance(item, EncodeCall):
            reply = answer(runner, item)
        elif isinstance(item, DenoiseCall):
            reply = runner.denoise(item.tokens, item.cache, item.self_conditioning)
            last.append((item.tokens.clone(), reply.clone()))  # the loop divides the reply in place
        elif isinstance(item, DoneEvent):
            result = item.result
    return result, last


def test_generated_tokens_carry_the_last_steps_log_probabilities(model):
    steps = 4
    result, calls = _generate_keeping_last_logits(model, [2, 5, 6], logprobs=3, max_new_tokens=8, **KW)
    per_canvas = result.stats.steps_per_canvas[0]
    assert len(per_canvas) == 1
    logits = calls[per_canvas[0] - 1][1][0]  # the canvas's last step, before temperature
    want = torch.log_softmax(logits, -1)
    tokens = result.tokens[0]
    got = torch.tensor(result.logprobs[0])
    # lse - logit in row chunks against log_softmax: the same quantity, fp32 rounding apart
    torch.testing.assert_close(got, want[torch.arange(8), torch.tensor(tokens)], rtol=0, atol=1e-5)
    for i, top in enumerate(result.top_logprobs[0]):
        assert [t for t, _ in top] == want[i].topk(3).indices.tolist()
        assert top[0][1] >= result.logprobs[0][i] - 1e-6 and len(top) == 3
    assert steps >= per_canvas[0]


def test_asking_for_logprobs_changes_no_token(model):
    with_lp = dgemma.generate(model, [[2, 5], [2, 7, 8]], logprobs=0, max_new_tokens=12, **KW)
    without = dgemma.generate(model, [[2, 5], [2, 7, 8]], max_new_tokens=12, **KW)
    assert with_lp.tokens == without.tokens and without.logprobs is None
    assert [len(x) for x in with_lp.logprobs] == [12, 12] and with_lp.top_logprobs[0][0] == []


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(logprobs=21), "logprobs must be"),
        (dict(logprobs=True), "logprobs must be"),
        (dict(logprobs=1, early_commit=True), "without early commit"),
        (dict(logprobs=1, mode="exact"), "mode 'fast'"),
    ],
)
def test_bad_logprobs_are_refused(model, kw, message):
    with pytest.raises(ValueError, match=message):
        dgemma.generate(model, [2, 5], max_new_tokens=2, **kw)


def test_prompt_logprobs_are_the_encoders_next_token_probabilities(model):
    prompt = [2, 9, 14, 3, 27, 5]
    chosen, tops = prompt_logprobs(model, prompt, k=2)
    assert chosen[0] is None and tops[0] is None
    want = score(model, prompt[:1], [prompt[1:]]).logprobs[0]  # another code path: two passes
    torch.testing.assert_close(torch.tensor(chosen[1:]), want, rtol=0, atol=1e-5)  # fp32 rounding
    assert all(len(t) == 2 and t[0][1] >= t[1][1] for t in tops[1:])


def test_canvas_logprobs_read_the_canvas_as_given(model):
    prompt, canvas = [2, 5, 6], [11, 12, 13]
    chosen, tops = canvas_logprobs(model, prompt, canvas, k=1)
    cache = model.new_cache(1, 3)
    model.encode(torch.tensor([prompt]), cache)
    full = torch.tensor([canvas + [1] * (model.config.canvas_length - 3)])  # end-of-text after it
    want = torch.log_softmax(model.denoise(full, cache)[0, :3], -1)
    torch.testing.assert_close(torch.tensor(chosen), want[[0, 1, 2], canvas], rtol=0, atol=1e-5)
    assert [t[0][0] for t in tops] == want.argmax(-1).tolist()
    with pytest.raises(ValueError, match="canvas of 1 to"):
        canvas_logprobs(model, prompt, [1] * (model.config.canvas_length + 1))


# -- the server ------------------------------------------------------------------------------------------


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_lm_evals_loglikelihood_payload(server, model_dir):
    tok = dgemma.Tokenizer.from_dir(model_dir)
    prompt = tok.encode("the cat sat on the mat", add_special_tokens=False)
    # exactly what lm-eval's local-completions sends for a loglikelihood request
    body = {"model": "tiny", "prompt": [prompt], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True, "max_denoising_steps": 3}  # fmt: skip
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    block = r.json()["choices"][0]["logprobs"]
    assert len(block["token_logprobs"]) == len(prompt) + 1 and block["token_logprobs"][0] is None
    assert block["top_logprobs"][0] is None and all(len(t) == 1 for t in block["top_logprobs"][1:])
    chosen, _ = prompt_logprobs(load_quiet(model_dir), prompt, 1)
    # the server's engine runs its own module set: the same passes, fp32 rounding apart
    assert block["token_logprobs"][1 : len(prompt)] == pytest.approx(chosen[1:], abs=1e-4)
    assert block["text_offset"][0] == 0 and block["tokens"][0] == tok.token_texts[prompt[0]]


def test_chat_logprobs_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2, max_tokens=6,
        seed=3, extra_body={"max_denoising_steps": 3},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= c.top_logprobs[0].logprob + 1e-6 for c in content)


def test_canvas_score_endpoint_matches_the_python_api(server, model_dir):
    r = _post(server, "/v1/canvas/score", {"prompt": [2, 5, 6], "canvas": [11, 12, 13], "top_logprobs": 1})
    assert r.status_code == 200, r.text
    chosen, _ = canvas_logprobs(load_quiet(model_dir), [2, 5, 6], [11, 12, 13], 1)
    assert r.json()["token_logprobs"] == pytest.approx(chosen, abs=1e-4)  # two module sets, fp32 rounding


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": 1, "stream": True}, "stream"),
        ("/v1/completions", {"prompt": "a", "logprobs": 1, "suffix": "b"}, "suffix"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "logprobs": True,
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ("/v1/canvas/score", {"prompt": [2], "canvas": [1] * 500}, "canvas"),
        ("/v1/canvas/score", {"prompt": [2], "canvas": [10**6]}, "canvas"),
    ],
)
def test_bad_logprob_requests_are_400s_naming_the_field(server, path, extra, param):
    r = _post(server, path, {**extra, "max_denoising_steps": 3} if "score" not in path else extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
