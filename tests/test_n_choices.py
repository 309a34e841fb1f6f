"""``n`` > 1 through the real stack, both placements: the choices share the prompt's KV on decode.

One encoder, decode and prefill process behind two gateway processes (colocated and
disaggregated); every request goes through the official ``openai`` client. What is shown:
``n=2`` greedy is two copies of the ``n=1`` answer (streamed or not, chat and completions,
with each choice's logprobs); a seeded sampled ``n=3`` is reproducible, the same in both
placements, its choices differ and choice 0 is the ``n=1`` text; usage sums the choices;
a stop-string / max_tokens mix and a stream the client leaves after its first chunk end
every choice; a choice a stop string ends on the gateway is retired on decode at once (decode's
``choices_retired_early_total``) while the others run to their full length. After every test each decode block is free again and nothing is held
(``tests/leaks.py``), which is the check that every choice retired and freed once.
"""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from cluster import PLACEMENTS
from proto.epd.v1 import epd_pb2 as pb
from proto.epd.v1 import epd_pb2_grpc as pb_grpc
# the same stack as the sampling tests (one per module): both placements, chunks of 8, leak-checked
from test_sampling_api import MODEL, clients, image_chat, nothing_leaks, served  # noqa: F401 (fixtures)


def chat_n(client: openai.OpenAI, messages, stream: bool, **kwargs):
    """``(texts, finish_reasons, logprob tokens per choice, usage)`` by choice index, streamed or not."""
    if not stream:
        c = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
        assert [ch.index for ch in c.choices] == list(range(len(c.choices)))
        return ([ch.message.content for ch in c.choices], [ch.finish_reason for ch in c.choices],
                [[e.token for e in ch.logprobs.content] if ch.logprobs else [] for ch in c.choices], c.usage)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
    n = kwargs.get("n", 1)
    texts, finishes, tokens = [""] * n, [None] * n, [[] for _ in range(n)]
    for chunk in chunks:
        assert len(chunk.choices) <= 1   # one choice's delta per chunk, as OpenAI streams n > 1
        for ch in chunk.choices:
            assert finishes[ch.index] is None, "a choice sent a delta after its finish_reason"
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason
            tokens[ch.index] += [e.token for e in ch.logprobs.content] if ch.logprobs else []
    return texts, finishes, tokens, chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_n2_greedy_is_two_copies_of_the_n1_answer(clients, placement, stream):
    client = clients[placement]
    messages, answer = image_chat(21)
    one, finish1, tokens1, usage1 = chat_n(client, messages, stream, temperature=0, max_tokens=12, logprobs=True)
    assert one[0].strip() == answer and finish1 == ["stop"]
    texts, finishes, tokens, usage = chat_n(client, messages, stream, temperature=0, max_tokens=12, n=2, logprobs=True)
    assert texts == [one[0], one[0]] and finishes == ["stop", "stop"]
    assert tokens == [tokens1[0], tokens1[0]] and tokens1[0]
    assert usage.completion_tokens == 2 * usage1.completion_tokens
    assert usage.prompt_tokens == usage1.prompt_tokens   # the prompt is counted (and prefilled) once


def test_a_seeded_n3_is_reproducible_distinct_and_the_same_in_both_placements(clients):
    messages, _ = image_chat(22)
    kwargs = dict(temperature=2.0, seed=4321, max_tokens=10, n=3)
    seen = {(p, stream): chat_n(c, messages, stream, **kwargs)[0] for p, c in clients.items() for stream in (False, True)}
    assert len({tuple(t) for t in seen.values()}) == 1, seen
    texts = next(iter(seen.values()))
    assert len(set(texts)) > 1, texts   # choice i draws from its own seed
    one = chat_n(clients["colocated"], messages, False, temperature=2.0, seed=4321, max_tokens=10)[0]
    assert one[0] == texts[0]           # choice 0 samples exactly as n=1 does


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_completions_n2_greedy_and_usage(clients, placement, stream):
    client = clients[placement]
    prompt = "A red circle"
    one = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
    if not stream:
        c = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, n=2)
        texts, finishes, used = [ch.text for ch in c.choices], [ch.finish_reason for ch in c.choices], c.usage
    else:
        texts, finishes, used = ["", ""], [None, None], None
        for chunk in client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, n=2,
                                               stream=True, stream_options={"include_usage": True}):
            for ch in chunk.choices:
                texts[ch.index] += ch.text
                finishes[ch.index] = ch.finish_reason or finishes[ch.index]
            used = chunk.usage or used
    assert texts == [one.choices[0].text] * 2 and finishes == [one.choices[0].finish_reason] * 2
    assert used.completion_tokens == 2 * one.usage.completion_tokens


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_stop_and_max_tokens_mix_ends_every_choice(clients, placement):
    """Sampled choices: some cut by a stop string here, some by max_tokens; each finishes on its own."""
    messages, _ = image_chat(23)
    texts, finishes, _, usage = chat_n(clients[placement], messages, True, temperature=2.0, seed=7, n=4,
                                       max_tokens=4, stop=["y"], extra_body={"ignore_eos": True})
    assert all(f in ("stop", "length") for f in finishes) and all("y" not in t for t in texts)
    assert {"stop", "length"} == set(finishes), (texts, finishes)
    assert usage.completion_tokens <= 4 * 4


def retired_early(cluster) -> int:
    """Decode's count of choices retired because the gateway ended them (a stop string matched there)."""
    with grpc.insecure_channel(cluster.by_role("decode")[0].address) as ch:
        return pb_grpc.DecodeStub(ch).Stats(pb.StatsRequest(since_sample=2**63), timeout=5).choices_retired_early_total


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_choice_a_stop_string_ends_is_retired_on_decode_and_the_others_run_on(served, clients, placement, stream):
    """n=3, sampled, no EOS: the choices a stop string ends here are retired on decode before the
    request ends (counted there), each freeing its own blocks once (the leak check after the test);
    the others are unharmed and run to max_tokens."""
    cluster, _ = served
    messages, _ = image_chat(26)
    before = retired_early(cluster)
    texts, finishes, _, usage = chat_n(clients[placement], messages, stream, temperature=2.0, seed=11, n=3,
                                       max_tokens=MAX_LONG, stop=["y"], extra_body={"ignore_eos": True})
    stopped = finishes.count("stop")
    assert 0 < stopped < 3 and finishes.count("length") == 3 - stopped, (texts, finishes)
    assert all("y" not in t for t in texts)
    assert retired_early(cluster) - before == stopped    # every stopped choice, and only those
    assert usage.completion_tokens > (3 - stopped) * MAX_LONG   # the long ones ran to their end
    no_stop = chat_n(clients[placement], messages, stream, temperature=2.0, seed=11, n=3, max_tokens=MAX_LONG,
                     extra_body={"ignore_eos": True})[1]
    assert no_stop == ["length"] * 3 and retired_early(cluster) - before == stopped   # nothing ended early


MAX_LONG = 24


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_stream_left_after_its_first_chunk_frees_every_choice(served, placement):
    _, gateways = served
    messages, _ = image_chat(24)
    body = {"model": MODEL, "messages": messages, "n": 3, "max_tokens": 200, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{gateways[placement].base}/v1/chat/completions",
                                                       json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())   # the first chunk, then the client goes away


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused_by_name(clients, n):
    messages, _ = image_chat(25)
    with pytest.raises(openai.BadRequestError) as info:
        clients["colocated"].chat.completions.create(model=MODEL, messages=messages, n=n, max_tokens=4)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        clients["colocated"].completions.create(model=MODEL, prompt="A", n=n, max_tokens=4)
    assert info.value.body["param"] == "n"
