"""``SubmitBatcher``: wait=false submits that arrive in one event-loop turn share a registry call
per shard, each request still gets its own answer or error, and nothing else changes."""

import asyncio

import pytest

from deployments.submits import SubmitBatcher
from registry.errors import InvalidRequest, Overloaded, RegistryError, Unavailable


class Registry:
    """What the Ingress's ``_call_shard`` does, in-process: records each call and answers
    like the registry (a description, or a RegistryError per refused request)."""

    def __init__(self, refuse: frozenset[str] = frozenset(), fail_calls: bool = False):
        self.calls: list[tuple[int, str, list[str]]] = []
        self.refuse = refuse
        self.fail_calls = fail_calls

    def _answer(self, request):
        req_id = request[0]
        if req_id in self.refuse:
            return Overloaded("too many pending requests", req_id)
        return {"req_id": req_id, "state": "pending", "receive_count": request[3]}

    async def __call__(self, shard, method, *args, req_id=None):
        await asyncio.sleep(0)  # a real call yields too
        if method == "submit":
            request, wait = args[:4], args[4]
            assert wait is False and req_id == request[0]
            self.calls.append((shard, method, [request[0]]))
            if self.fail_calls:
                raise Unavailable("the registry was down", req_id)
            answer = self._answer(request)
            if isinstance(answer, RegistryError):
                raise answer
            return answer
        assert method == "submit_many" and req_id is None
        (requests,) = args
        self.calls.append((shard, method, [request[0] for request in requests]))
        if self.fail_calls:
            raise Unavailable("the registry was down")
        return [self._answer(request) for request in requests]


def request(req_id, receive_count=2):
    return (req_id, [], "digest-" + req_id, receive_count)


async def gather_outcomes(batcher, submits):
    return await asyncio.gather(*(batcher.submit(shard, req) for shard, req in submits), return_exceptions=True)


def test_submits_of_one_turn_share_one_call_per_shard_in_their_order():
    registry = Registry()
    batcher = SubmitBatcher(registry, max_requests=64)
    submits = [(0, request("a")), (1, request("b")), (0, request("c")), (0, request("d"))]
    out = asyncio.run(gather_outcomes(batcher, submits))
    assert [o["req_id"] for o in out] == ["a", "b", "c", "d"]
    assert sorted(registry.calls) == [(0, "submit_many", ["a", "c", "d"]), (1, "submit", ["b"])]


def test_a_lone_request_goes_as_a_plain_submit_and_later_turns_make_new_calls():
    registry = Registry()
    batcher = SubmitBatcher(registry, max_requests=64)

    async def one_after_another():
        return [await batcher.submit(0, request(r)) for r in ("a", "b")]

    out = asyncio.run(one_after_another())
    assert [o["req_id"] for o in out] == ["a", "b"]
    assert registry.calls == [(0, "submit", ["a"]), (0, "submit", ["b"])]


def test_batches_hold_at_most_max_requests():
    registry = Registry()
    batcher = SubmitBatcher(registry, max_requests=2)
    out = asyncio.run(gather_outcomes(batcher, [(0, request(r)) for r in "abcde"]))
    assert [o["req_id"] for o in out] == list("abcde")
    assert registry.calls == [(0, "submit_many", ["a", "b"]), (0, "submit_many", ["c", "d"]), (0, "submit", ["e"])]


def test_a_refused_request_fails_alone():
    registry = Registry(refuse=frozenset({"b"}))
    batcher = SubmitBatcher(registry, max_requests=64)
    out = asyncio.run(gather_outcomes(batcher, [(0, request(r)) for r in "abc"]))
    assert out[0]["req_id"] == "a" and out[2]["req_id"] == "c"
    assert isinstance(out[1], Overloaded) and out[1].req_id == "b"
    assert out[1].__traceback__ is not None  # raised in the caller, as its own error


def test_a_failed_call_fails_each_of_its_requests_with_its_own_req_id():
    registry = Registry(fail_calls=True)
    batcher = SubmitBatcher(registry, max_requests=64)
    out = asyncio.run(gather_outcomes(batcher, [(0, request(r)) for r in "ab"] + [(1, request("c"))]))
    assert [type(o) for o in out] == [Unavailable] * 3
    assert [o.req_id for o in out] == ["a", "b", "c"]
    assert all(o.message == "the registry was down" for o in out)


@pytest.mark.parametrize("after_the_call_left", [False, True], ids=["before-the-call-left", "after-the-call-left"])
def test_a_caller_that_leaves_does_not_take_the_others_answers_with_it(after_the_call_left):
    registry = Registry()
    batcher = SubmitBatcher(registry, max_requests=64)

    async def run():
        gone = asyncio.ensure_future(batcher.submit(0, request("gone")))
        stays = asyncio.ensure_future(batcher.submit(0, request("stays")))
        await asyncio.sleep(0)  # both queued
        while after_the_call_left and not registry.calls:  # until the call is on its way
            await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await stays

    assert asyncio.run(run())["req_id"] == "stays"
    # Gone before its call left, it is not sent at all; after, the others' call goes on.
    expected = [(0, "submit_many", ["gone", "stays"])] if after_the_call_left else [(0, "submit", ["stays"])]
    assert registry.calls == expected


def test_invalid_request_from_the_registry_keeps_its_code():
    async def refuse(shard, method, *args, req_id=None):
        if method == "submit_many":
            return [InvalidRequest("receive_count must be at least 1", req[0]) for req in args[0]]
        raise InvalidRequest("receive_count must be at least 1", req_id)

    batcher = SubmitBatcher(refuse, max_requests=64)
    out = asyncio.run(gather_outcomes(batcher, [(0, request("a", 0)), (0, request("b", 0))]))
    assert [(o.code, o.req_id) for o in out] == [("invalid_request", "a"), ("invalid_request", "b")]


class Broken(Registry):
    """A registry call that fails with a bug (not a ``RegistryError``) or answers the wrong length."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    async def __call__(self, shard, method, *args, req_id=None):
        await asyncio.sleep(0)
        if self.how == "short" and method == "submit_many":
            return [self._answer(args[0][0])]
        raise KeyError("a bug in the registry")


@pytest.mark.parametrize(("how", "count"), [("bug", 1), ("bug", 3), ("short", 3)], ids=["bug-one", "bug-batched", "short-answer"])
def test_every_caller_is_answered_when_a_call_fails_with_a_bug(how, count):
    batcher = SubmitBatcher(Broken(how), max_requests=64)

    async def run():
        return await asyncio.wait_for(gather_outcomes(batcher, [(0, request(f"r{i}")) for i in range(count)]), 5)

    outcomes = asyncio.run(run())  # no caller hangs
    assert len(outcomes) == count and all(isinstance(o, (KeyError, RuntimeError)) for o in outcomes)
