"""``torch.compile(cm)`` of a compiled model: drop-in and shared-layout calls stay exact.

Dynamo used to trace the drop-in request detection, whose bitwise row comparison views each
request input as bytes (``view(torch.uint8)``); AOTAutograd regenerates such an output alias
with the base's dtype, and the first drop-in call failed with ``setStorage: ... out of
bounds``. The grouping now runs outside dynamo's trace (``runtime/call/grouping.group``); the shared
program is still traced. Oracle: the original model on the replicated batch.
"""

from __future__ import annotations

import torch
from models_for_tests import DICT_FEATURES, USER_ITEM_MLP, assert_outputs_match, eager

# AOTAutograd is where the alias of the byte view broke; Inductor shares it and costs more here.
BACKEND = "aot_eager"
RAGGED = ([2, 3, 1], [1, 4, 2])


def _run(case, batches=RAGGED):
    model = case.build()
    compiled = torch.compile(case.compile(model), backend=BACKEND)
    with torch.no_grad():
        for seed, counts in enumerate(batches):
            batch = case.batch(counts, seed=seed + 7, shuffle=seed % 2 == 1)
            want = eager(model, batch.replicated())
            assert_outputs_match(compiled(**batch.replicated()), want, f"drop-in {counts}")
            shared = compiled(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
            assert_outputs_match(shared, want, f"shared layout {counts}")


def test_torch_compile_of_a_compiled_model_is_exact_in_both_layouts():
    torch._dynamo.reset()
    _run(USER_ITEM_MLP)


def test_torch_compile_of_a_compiled_model_with_dict_inputs():
    torch._dynamo.reset()
    _run(DICT_FEATURES, RAGGED[:1])
