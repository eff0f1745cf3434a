"""A scheduler's local view of registry entries, driven directly (no Ray, no vLLM)."""

from registry.engines.vllm.scheduler_view import MAX_POISONED, EngineView


def test_a_new_item_is_asked_about_and_its_request_waits_for_the_answer():
    view = EngineView()
    assert view.track("chat-1", ["a", "b"]) is True
    assert view.track("chat-1", ["a", "b"]) is False
    assert view.to_watch() == {"a": None, "b": None}
    assert not view.ready("chat-1", ["a", "b"])
    view.apply({"a": "staged", "b": "pending"})
    assert view.has("a") and view.has("b")
    assert not view.ready("chat-1", ["a", "b"])  # b is still being encoded
    assert view.ready("chat-1", ["a"])  # b's tokens are already computed: only a is needed
    view.apply({"b": "staged"})
    assert view.ready("chat-1", ["a", "b"])
    assert view.take_unavailable() == {}


def test_never_encoded_and_released_items_are_computed_by_the_engine():
    view = EngineView()
    view.track("chat-1", ["x", "y"])
    view.apply({"x": "unknown", "y": "released"})
    assert view.ready("chat-1", ["x", "y"])
    assert not view.has("x") and not view.has("y")
    assert view.take_unavailable() == {}
    assert view.to_watch() == {}  # decided for good: nothing left to watch


def test_items_that_end_badly_or_are_lost_are_computed_by_the_engine_by_default():
    view = EngineView()
    for request_id, identifier in [("c1", "f"), ("c2", "e"), ("c3", "c"), ("c4", "lost")]:
        view.track(request_id, [identifier])
    view.apply({"f": "pending", "e": "staged", "c": "pending", "lost": "staged"})
    view.apply({"f": "failed", "e": "expired", "c": "cancelled", "lost": "unknown"})
    assert view.take_unavailable() == {}
    for request_id, identifier in [("c1", "f"), ("c2", "e"), ("c3", "c"), ("c4", "lost")]:
        assert view.ready(request_id, [identifier]) and not view.has(identifier)  # the engine encodes it
    fallbacks = view.take_fallbacks()
    assert set(fallbacks) == {"f", "e", "c", "lost"} and "failed" in fallbacks["f"] and "restarted" in fallbacks["lost"]
    assert view.take_fallbacks() == {}  # each told once


def test_an_item_a_worker_could_not_load_still_fails_with_the_fallback():
    view = EngineView()
    view.track("chat-1", ["a"])
    view.apply({"a": "staged"})
    view.hand_over("a")
    view.load_failed({"a": "[not_ready] timed out"})  # handed over: the engine believes it cached
    assert set(view.take_unavailable()) == {"chat-1"}
    view.finish("chat-1")
    view.track("chat-2", ["a"])
    view.apply({"a": "failed"})  # a placeholder is cached: computing it "itself" would use zeros
    assert set(view.take_unavailable()) == {"chat-2"} and view.take_fallbacks() == {}


def test_without_the_fallback_items_that_end_badly_make_their_requests_unavailable():
    view = EngineView(local_fallback=False)
    for request_id, identifier in [("c1", "f"), ("c2", "e"), ("c3", "c"), ("c4", "lost")]:
        view.track(request_id, [identifier])
    view.track("c5", ["f"])  # two requests share an item
    view.apply({"f": "pending", "e": "staged", "c": "pending", "lost": "staged"})
    view.apply({"f": "failed", "e": "expired", "c": "cancelled", "lost": "unknown"})
    unavailable = view.take_unavailable()
    assert set(unavailable) == {"c1", "c2", "c3", "c4", "c5"}
    assert "failed" in unavailable["c1"] and "restarted" in unavailable["c4"]
    assert view.take_unavailable() == {}  # each reported once


def test_an_item_handed_to_the_workers_is_no_longer_watched():
    view = EngineView()
    view.track("chat-1", ["a"])
    view.apply({"a": "staged"})
    view.hand_over("a")
    assert view.to_watch() == {}
    view.apply({"a": "released"})  # released by our own ranks: not a failure
    assert view.take_unavailable() == {}


def test_finishing_forgets_items_and_a_later_request_asks_again():
    view = EngineView()
    view.track("chat-1", ["a", "b"])
    view.track("chat-0", ["b"])
    view.apply({"a": "released"})
    assert view.finish("chat-1") == ["a"]  # "b" is still named by chat-0
    assert view.finish("chat-0") == ["b"]
    assert view.state("a") is None and view.tracked() == 0
    view.track("chat-2", ["a"])  # the proxy may have staged it afresh
    assert view.to_watch() == {"a": None}


def test_a_stale_watch_is_detected():
    view = EngineView()
    view.track("chat-1", ["a"])
    view.asked(view.to_watch())
    assert not view.watch_is_stale()
    view.track("chat-2", ["b"])
    assert view.watch_is_stale()


def test_a_failed_load_poisons_the_item_until_it_is_reloaded():
    view = EngineView()
    view.track("chat-1", ["a"])
    view.apply({"a": "staged"})
    view.hand_over("a")
    view.load_failed({"a": "[not_ready] timed out"})
    assert set(view.take_unavailable()) == {"chat-1"}
    view.finish("chat-1")
    # The engine believes "a" is cached (a placeholder): a later request must reload it.
    view.track("chat-2", ["a"])
    view.apply({"a": "pending"})
    assert not view.ready("chat-2", ["a"])
    view.apply({"a": "staged"})
    assert view.ready("chat-2", ["a"])
    assert view.take_reloads() == {"a"}
    view.loaded({"a"})
    view.track("chat-3", ["a"])
    view.apply({"a": "staged"})
    assert view.ready("chat-3", ["a"]) and view.take_reloads() == set()
    # Not staged again: the request cannot run on the placeholder.
    view.load_failed({"b": "gone"})
    view.track("chat-4", ["b"])
    view.apply({"b": "unknown"})
    assert not view.ready("chat-4", ["b"])
    assert set(view.take_unavailable()) == {"chat-4"}


def test_poisoned_items_are_bounded():
    view = EngineView()
    view.load_failed({f"i{n}": "x" for n in range(MAX_POISONED + 10)})
    assert len(view._poisoned) == MAX_POISONED


def test_a_new_request_asks_again_about_an_item_decided_for_an_earlier_one():
    view = EngineView()
    view.track("chat-1", ["a"])
    view.apply({"a": "unknown"})  # chat-1 computes it itself
    assert view.to_watch() == {}
    view.track("chat-2", ["a"])  # meanwhile the service may have staged it
    assert view.to_watch() == {"a": None}
    assert not view.ready("chat-2", ["a"])
    view.apply({"a": "staged"})
    assert view.ready("chat-2", ["a"]) and view.take_unavailable() == {}


def test_the_view_awaits_the_registry_while_an_item_is_unheard_of_or_pending_and_not_handed_over():
    view = EngineView()
    assert not view.awaiting()
    view.track("chat-1", ["a", "b"])
    assert view.awaiting()  # neither heard of yet
    view.apply({"a": "staged", "b": "pending"})
    assert view.awaiting()  # b is pending
    view.apply({"b": "staged"})
    assert not view.awaiting()
    view.track("chat-2", ["c"])
    view.hand_over("c")  # handed over: the workers ask for it, the scheduler waits for nothing
    assert not view.awaiting()


def test_what_a_silent_registry_left_undecided_is_computed_by_the_engine_or_fails_its_request():
    for fallback in (True, False):
        view = EngineView(local_fallback=fallback)
        for request_id, identifier in [("c1", "unheard"), ("c2", "pending"), ("c3", "staged")]:
            view.track(request_id, [identifier])
        view.apply({"pending": "pending", "staged": "staged"})
        view.asked({"unheard": None, "pending": "pending", "staged": "staged"}, shard=0)
        assert view.asked_of(0) == {"unheard": None, "pending": "pending", "staged": "staged"}
        view.unanswered(view.asked_of(0), "the registry did not answer within 10 s")
        # Never heard of: decided unknown, the engine encodes it silently (as with no registry).
        assert view.ready("c1", ["unheard"]) and view.state("unheard") == "unknown"
        # Staged stays staged: the registry said so before it went silent.
        assert view.state("staged") == "staged" and view.ready("c3", ["staged"])
        if fallback:
            assert view.ready("c2", ["pending"])
            assert view.take_fallbacks() == {"pending": "the registry did not answer within 10 s"}
        else:
            assert not view.ready("c2", ["pending"])
            assert view.take_unavailable() == {"c2": "pending: the registry did not answer within 10 s"}
        assert view.to_watch() == {"staged": "staged"}
