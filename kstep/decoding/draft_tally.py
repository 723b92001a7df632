"""What self-speculation's drafts did, per row of the batch (self_speculation.py and
block_self_speculation.py keep one each): drafts offered beyond each pass's exact step, those kept,
where the broken ones broke, and the positions the passes computed for the row, so a batch's result
reports each row's own figures (its rows' sums are the batch's)."""
import torch

from kstep.runner.model_runner import ForwardPass


def count_breaks(chain: torch.Tensor, exact_next: torch.Tensor, in_chain: torch.Tensor, kept: torch.Tensor,
                 live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each live row's drafts broke (chain (B, K, L), the exact step from each (B, K, L), kept
    (B,)): (B,) rows whose exact step filled other positions than the next draft, (B,) rows where it
    filled the same positions with other tokens. A row whose drafts all held is in neither."""
    b = torch.arange(chain.shape[0], device=chain.device)
    broke = live & (kept + 1 < chain.shape[1]) & in_chain[b, (kept + 1).clamp(max=chain.shape[1] - 1)]
    at = kept.clamp(max=chain.shape[1] - 2)
    base, drafted, exact = chain[b, at], chain[b, at + 1], exact_next[b, at]  # (B, L) each
    same_places = ((drafted != base) == (exact != base)).all(-1)
    return broke & ~same_places, broke & same_places


class DraftTally:
    def __init__(self, rows: int, device: torch.device, equals: str):
        counts = lambda: torch.zeros(rows, dtype=torch.long, device=device)  # noqa: E731
        self.drafted, self.accepted, self.positions = counts(), counts(), counts()
        self.broke_on_position, self.broke_on_token = counts(), counts()
        self.equals = equals  # the sampler whose tokens the run gives (docs/decoding.md)

    def count_pass(self, forward: ForwardPass, owners: torch.Tensor | None = None) -> None:
        """A pass's positions, to the batch rows its rows belong to (`owners` (R,); None: row r is row r)."""
        width = forward.ids.shape[1]
        if owners is None:
            self.positions += width
        else:
            self.positions.index_add_(0, owners, torch.full_like(owners, width))

    def count_round(self, chain: torch.Tensor, exact_next: torch.Tensor, in_chain: torch.Tensor,
                    kept: torch.Tensor) -> None:
        """One verification: each live row's drafts beyond the first, those kept (`kept` (B,)), where they broke."""
        live = in_chain[:, 0]
        self.drafted += in_chain[:, 1:].sum(-1) * live
        self.accepted += kept * live
        on_position, on_token = count_breaks(chain, exact_next, in_chain, kept, live)
        self.broke_on_position += on_position
        self.broke_on_token += on_token

    def stats(self, row: int | None = None) -> dict[str, float | str]:
        """The batch's figures, or row `row`'s."""
        pick = (lambda t: int(t.sum())) if row is None else (lambda t: int(t[row]))
        drafted, accepted = pick(self.drafted), pick(self.accepted)
        return {"acceptance_rate": accepted / drafted if drafted else 0.0, "drafted_tokens": drafted,
                "accepted_tokens": accepted, "positions_computed": pick(self.positions),
                "broke_on_position": pick(self.broke_on_position), "broke_on_token": pick(self.broke_on_token),
                "equals": self.equals}
