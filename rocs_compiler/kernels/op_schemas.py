"""The schema of every ``rocs::`` op, the one place both the op library (``library.py``, which
registers them with torch) and the op records (``rocs_op.py``) read it from. Imports nothing."""

# name -> schema of every rocs:: op (the argument list and result of ``rocs::<name>``)
SCHEMAS: dict[str, str] = {
    "broadcast_linear": "(Tensor c, Tensor weight, Tensor? bias, Tensor request_term, "
    "Tensor candidate_to_request) -> Tensor",
    "broadcast_linear_compression": "(Tensor ec, Tensor weight, Tensor request_term, "
    "Tensor candidate_to_request) -> Tensor",
    "broadcast_attention": "(Tensor q, Tensor k, Tensor v, Tensor candidate_to_request, "
    "Tensor? key_mask=None, float? scale=None, Tensor? key_bias=None) -> Tensor",
    "broadcast_interaction": "(Tensor request_stack, Tensor candidate_stack, "
    "Tensor candidate_to_request) -> Tensor",
    "broadcast_pointwise": "(str program, Tensor[] candidate_inputs, Tensor[] request_inputs, "
    "Tensor candidate_to_request) -> Tensor",
    "embedding_bag_rows": "(Tensor weight, Tensor indices, int mode, int? padding_idx) -> Tensor",
    "nested_padding": "(Tensor states, Tensor padding_mask, Tensor? candidate_to_request=None) "
    "-> Tensor",
}
