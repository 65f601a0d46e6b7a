"""The server role's Attempt (fedcore.roles.server): what it keeps once its round is combined."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from fedcore.roles.server import Attempt
from fedcore.transport import Payload


def test_a_released_attempt_keeps_metas_and_lets_go_of_every_tensor() -> None:
    # Prepare: one plan object for both clients (as a round's model is), a task built from it,
    # an upload kept whole
    model = {"w": np.ones(1000, dtype=np.float32)}
    plan = Payload(meta={"round": 3}, tensors=model)
    attempt = Attempt(round=3, attempt=1, plans={0: plan, 1: plan}, spec_digest="d")
    task = attempt.task_for(0)
    attempt.uploads[0] = Payload(meta={"num_examples": 5}, tensors={"w": np.zeros(1000)})
    attempt.failed[1] = "absent"
    kept = [weakref.ref(model["w"]), weakref.ref(attempt.uploads[0].tensors["w"])]
    assert task.tensors["w"] is model["w"]
    # Execute
    attempt.release()
    del model, plan, task
    gc.collect()
    # Assert: nothing of the round's tensors is alive; who was asked and what they said is
    assert [ref() for ref in kept] == [None, None]
    assert {k: p.meta for k, p in attempt.plans.items()} == {0: {"round": 3}, 1: {"round": 3}}
    assert attempt.uploads[0].meta == {"num_examples": 5} and not attempt.uploads[0].tensors
    assert attempt.settled() and not attempt.pending(0) and not attempt.pending(1)


def test_a_clients_own_words_reach_the_log_as_one_bounded_line() -> None:
    # Prepare: what a hostile client may send as its reason and message (kind "failed" or
    # "refused"): control characters, a forged log line, far too much text.
    from fedcore.roles.server import _client_words, _round_of

    message = Payload(
        meta={"reason": "Bad\nERROR forged" + "r" * 100, "message": "x\r\n\x1b[31m" + "m" * 5000}
    )
    # Execute
    reason, text = _client_words(message, default="Failed")
    empty = _client_words(Payload(meta={}), default="Failed")
    # Assert
    assert reason == ("Bad ERROR forged" + "r" * 100)[:64]
    assert text == ("x   [31m" + "m" * 5000)[:1000]
    assert all(c.isprintable() for c in reason + text)
    assert empty == ("Failed", "")
    rounds = [_round_of(Payload(meta={"round": r})) for r in (4, "4" * 5000, True, None)]
    assert rounds == [4, None, None, None]
