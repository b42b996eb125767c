"""DLRM by hand for the shared layout.

The bottom MLP and the four user tables run at R rows. Of the 28 pairwise dots, the 10 between
request features are computed at R rows; the 15 between an item and a request feature take the
request features gathered to N rows (one ``bmm``), the 3 between items run at N rows. The top
MLP's first linear is split (:class:`SplitLinear`): the dense output and the request-request
dots are multiplied at R rows and gathered, the other 18 dots at N rows. The rest of the top MLP
is the model's own.
"""

from __future__ import annotations

import torch
from torch import nn

from models_zoo.dlrm import DLRM

from .pieces import SplitLinear


class HandDLRM(nn.Module):
    def __init__(self, model: DLRM):
        super().__init__()
        self.model = model
        num_request = 1 + len(model.user_tables)  # the bottom MLP's output and the user tables
        pairs = {(int(i), int(j)): p for p, (i, j) in enumerate(zip(model.li, model.lj))}
        width = model.bottom[-2].out_features
        num_items = len(model.item_tables)
        request_pairs = [(i, j) for (i, j) in pairs if i < num_request]
        item_request = [(num_request + a, j) for a in range(num_items) for j in range(num_request)]
        item_item = [(num_request + a, num_request + b) for a in range(num_items) for b in range(a)]
        li, lj = torch.tril_indices(num_items, num_items, offset=-1)
        self.register_buffer("request_li", torch.tensor([i for i, _ in request_pairs]))
        self.register_buffer("request_lj", torch.tensor([j for _, j in request_pairs]))
        self.register_buffer("item_li", li)
        self.register_buffer("item_lj", lj)
        # top[0]'s input is [dense (width), pairs]; its columns sorted into the two sides
        column = {pair: width + p for pair, p in pairs.items()}
        request_columns = [*range(width), *(column[p] for p in request_pairs)]
        candidate_columns = [column[p] for p in item_request + item_item]
        top0 = model.top[0]
        self.top0 = SplitLinear(top0.weight, top0.bias, request_columns, candidate_columns)
        self.top_rest = nn.Sequential(*list(model.top)[1:])

    def forward(self, user_dense, user_sparse, item_sparse, candidate_to_request):
        m = self.model
        dense_out = m.bottom(user_dense)  # [R, D]
        user_embs = [table(user_sparse[:, i]) for i, table in enumerate(m.user_tables)]
        request = torch.stack([dense_out, *user_embs], dim=1)  # [R, 5, D]
        request_dots = torch.bmm(request, request.transpose(1, 2))[
            :, self.request_li, self.request_lj
        ]
        items = torch.stack(
            [table(item_sparse[:, i]) for i, table in enumerate(m.item_tables)], dim=1
        )  # [N, 3, D]
        gathered = request.index_select(0, candidate_to_request)
        item_request = torch.bmm(items, gathered.transpose(1, 2)).flatten(1)  # [N, 15]
        item_item = torch.bmm(items, items.transpose(1, 2))[:, self.item_li, self.item_lj]
        x = self.top0(
            torch.cat([dense_out, request_dots], dim=1),
            torch.cat([item_request, item_item], dim=1),
            candidate_to_request,
        )
        return self.top_rest(x).squeeze(-1)
