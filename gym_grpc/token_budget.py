"""A rollout's token budget for the whole trajectory (an agent's `max_rollout_tokens`): what a trainer
that cuts a multi-turn sample at a total response length would keep, so that no turn is generated
past it (docs/training.md#a-budget-for-the-whole-trajectory)."""

from __future__ import annotations

from gym_grpc import errors
from gym_grpc.v1 import responses_pb2 as r


class TokenBudget:
    """A rollout's budget of tokens after the prompt (ToolLoopConfig.max_rollout_tokens), as a trainer
    that cuts a multi-turn sample at a total response length counts them, from the model's usage:
    turn k's input_tokens + output_tokens - turn 0's input_tokens, i.e. every token generated or
    returned by a tool since the prompt (and the chat template's tokens around them).

    The tool outputs of a turn are counted when the next model call reports its input_tokens, so the
    cap on a call (`limit`) cannot count those just added: the trajectory may end past the budget by
    as many tokens as the last turn's tool outputs hold, and no more."""

    def __init__(self, tokens: int, own: int | None, model_server: str) -> None:
        self.tokens = tokens
        #: The request's own max_output_tokens; a smaller one is kept, and a turn it cuts stays INCOMPLETE.
        self.own = own
        self.model_server = model_server
        #: Tokens of the trajectory after the prompt, as of the last model call.
        self.used = 0
        self._prompt: int | None = None
        #: The budget's cap on the last model call; None when the request's own limit was the smaller.
        self._cap: int | None = None

    @classmethod
    def of(cls, tokens: int | None, params: r.CreateParams, model_server: str) -> TokenBudget | None:
        """The budget of an agent's `max_rollout_tokens` for the model calls `params` starts (their own
        max_output_tokens kept when smaller); None without one."""
        if tokens is None:
            return None
        own = params.max_output_tokens if params.HasField("max_output_tokens") else None
        return cls(tokens, own, model_server)

    def limit(self) -> int:
        """The max_output_tokens of the next model call: what the budget has left, or the request's own if smaller."""
        left = self.tokens - self.used
        if self.own is not None and self.own <= left:
            self._cap = None
            return self.own
        self._cap = left
        return left

    def took(self, response: r.Response) -> None:
        """Count a model call's response."""
        usage = response.usage
        if usage.input_tokens == 0:
            if response.status == r.RESPONSE_STATUS_INCOMPLETE:
                return  # nothing generated: a context-length error the model server answers as incomplete
            raise errors.FailedPrecondition(
                f"max_rollout_tokens: model server {self.model_server!r} reports no usage (input_tokens), "
                "so the rollout's tokens cannot be counted; serve a model that reports usage or set it to null"
            )
        if self._prompt is None:
            self._prompt = usage.input_tokens
        self.used = max(self.used, usage.input_tokens + usage.output_tokens - self._prompt)

    @property
    def spent(self) -> bool:
        return self.used >= self.tokens

    def cut(self, response: r.Response) -> bool:
        """Whether an incomplete response was cut at the budget's cap (not at the request's own limit,
        not by a full context, which generates nothing)."""
        return (
            self._cap is not None
            and response.incomplete_details.reason == r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
            and response.usage.output_tokens >= self._cap
        )
