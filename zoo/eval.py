"""Evaluation: accuracy at query positions, overall and per slice.

Accuracy per example is the fraction of its queries answered correctly; the overall figure and each slice
(`valid/accuracy/num_kv_pairs=64`, `valid/accuracy/seq_len=256`, ...) average it over examples.
"""

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zoo.synthetics import Segment


@dataclass
class QuerySegment:
    """A segment on the device, with its query positions gathered once into fixed shapes.

    inputs: [N, L]; query_pos: [N, Q] positions of the queries (padded with 0); query_labels: [N, Q] their
    targets (padding is -100). Fixed shapes let a training step gather query logits without a host sync.
    """

    inputs: torch.Tensor
    query_pos: torch.Tensor
    query_labels: torch.Tensor
    slices: dict[str, int]
    batch_size: int

    @classmethod
    def from_segment(cls, segment: Segment, batch_size: int, device: torch.device) -> "QuerySegment":
        labels = segment.labels
        is_query = labels != -100  # [N, L]
        num_queries = is_query.sum(1)
        if int(num_queries.min()) < 1:
            raise ValueError(f"segment {segment.slices} has an example without queries")
        q = int(num_queries.max())
        # Stable sort puts query positions first, in order; the rest is padding.
        order = torch.sort((~is_query).to(torch.int8), dim=1, stable=True).indices[:, :q]  # [N, Q]
        query_labels = labels.gather(1, order)
        pad = torch.arange(q).expand_as(order) >= num_queries[:, None]
        query_labels = query_labels.masked_fill(pad, -100)
        query_pos = order.masked_fill(pad, 0)
        return cls(segment.inputs.to(device), query_pos.to(device), query_labels.to(device), dict(segment.slices),
                   batch_size)

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def num_batches(self) -> int:
        return math.ceil(len(self) / self.batch_size)


def query_logits(model, inputs: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """Logits at the query positions only: [B, Q, V]. The vocabulary head never sees the other positions."""
    h = model.hidden_states(inputs)  # [B, L, d]
    hq = h.gather(1, query_pos[..., None].expand(-1, -1, h.shape[-1]))  # [B, Q, d]
    return model.logits(hq)  # [B, Q, V]


def query_loss(model, inputs: torch.Tensor, query_pos: torch.Tensor, query_labels: torch.Tensor) -> torch.Tensor:
    logits = query_logits(model, inputs, query_pos)
    return F.cross_entropy(logits.flatten(0, 1).float(), query_labels.flatten(), ignore_index=-100)


@torch.no_grad()
def evaluate(model, segments: list[QuerySegment], split: str, autocast=None) -> dict[str, float]:
    """`{split}/accuracy`, `{split}/loss` and `{split}/accuracy/<slice>=<value>` over all segments."""
    was_training = model.training
    model.eval()
    acc_sum = defaultdict(lambda: 0.0)
    count = defaultdict(int)
    loss_sum, loss_count = 0.0, 0
    for seg in segments:
        seg_acc = torch.zeros((), device=seg.inputs.device, dtype=torch.float64)
        seg_loss = torch.zeros((), device=seg.inputs.device, dtype=torch.float64)
        seg_tokens = torch.zeros((), device=seg.inputs.device, dtype=torch.float64)
        for start in range(0, len(seg), seg.batch_size):
            sl = slice(start, start + seg.batch_size)
            labels = seg.query_labels[sl]
            with autocast if autocast is not None else torch.autocast("cpu", enabled=False):
                logits = query_logits(model, seg.inputs[sl], seg.query_pos[sl]).float()
            valid = labels != -100
            correct = (logits.argmax(-1) == labels) & valid
            seg_acc += (correct.sum(1) / valid.sum(1)).sum()
            seg_loss += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            seg_tokens += valid.sum()
        n = len(seg)
        acc_total = float(seg_acc)
        acc_sum[None] += acc_total
        count[None] += n
        for key, value in seg.slices.items():
            acc_sum[(key, value)] += acc_total
            count[(key, value)] += n
        loss_sum += float(seg_loss)
        loss_count += int(seg_tokens)
    model.train(was_training)
    metrics = {f"{split}/accuracy": acc_sum[None] / count[None], f"{split}/loss": loss_sum / loss_count}
    for key in sorted(k for k in acc_sum if k is not None):
        metrics[f"{split}/accuracy/{key[0]}={key[1]}"] = acc_sum[key] / count[key]
    return metrics
