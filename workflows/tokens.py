"""TokensWorkflow (id `tokens`): the HTTP API's tokens, durable and shared by every `astraeus api` process.

`astraeus token create|revoke` are its updates and every API process reads the table with its `tokens` query. Only a
token's digest travels here (never its secret), and never through a run's history. It runs no activity: a change is
done once the update returns; the API processes see it at their next read (within a few seconds)."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.domain.tokens import Token
    from workflows.messages import RevokeTokenRequest, TokensInput


@workflow.defn(name=contracts.TOKENS_WORKFLOW)
class TokensWorkflow:
    @workflow.init
    def __init__(self, input: TokensInput) -> None:
        self._tokens: dict[str, Token] = {t.id: t for t in input.tokens}

    @workflow.run
    async def run(self, input: TokensInput) -> None:
        # Nothing to do but answer; its history grows by each change only, and is carried on when it is long.
        await workflow.wait_condition(lambda: workflow.info().is_continue_as_new_suggested())
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(TokensInput(tokens=self._list()))

    def _list(self) -> list[Token]:
        return sorted(self._tokens.values(), key=lambda t: (t.created_at, t.id))

    @workflow.update(name=contracts.ADD_TOKEN.name)
    def add_token(self, token: Token) -> list[Token]:
        self._tokens[token.id] = token
        return self._list()

    @add_token.validator
    def _validate_add(self, token: Token) -> None:
        if token.id in self._tokens or any(t.sha256 == token.sha256 for t in self._tokens.values()):
            raise ApplicationError(f"token {token.id} exists already", type="TokenExists")

    @workflow.update(name=contracts.REVOKE_TOKEN.name)
    def revoke_token(self, request: RevokeTokenRequest) -> list[Token]:
        del self._tokens[request.id]
        return self._list()

    @revoke_token.validator
    def _validate_revoke(self, request: RevokeTokenRequest) -> None:
        if request.id not in self._tokens:
            raise ApplicationError(f"no token {request.id}", type="NoToken")

    @workflow.query(name=contracts.TOKENS.name)
    def tokens(self) -> list[Token]:
        return self._list()
