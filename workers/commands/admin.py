"""The cluster's administration: namespace quotas, the HTTP API's tokens and the cluster CA."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from workers.commands.inputs import ca_dir
from workers.commands.options import emit, temporal_client
from workers.errors import AstraeusError
from workflows.domain.scheduling.quotas import Quota
from workflows.domain.spec import format_errors


async def cmd_quota(args: argparse.Namespace) -> int:
    from workers.admin import quotas, remove_quota, render_quotas, set_quota

    temporal = (await temporal_client(args)).temporal
    if args.verb != "ls" and not args.namespace:
        raise AstraeusError(f"quota {args.verb}: name the namespace")
    if args.verb == "set":
        try:
            quota = Quota(namespace=args.namespace, gpus=args.gpus, cpu=args.cpu, memory_bytes=args.memory_bytes,
                          pools=tuple(args.pool))  # fmt: skip
        except ValidationError as error:
            raise AstraeusError(f"quota set {args.namespace}:\n{format_errors(error)}") from None
        listed = await set_quota(temporal, quota)
    elif args.verb == "rm":
        listed = await remove_quota(temporal, args.namespace)
    else:
        listed = await quotas(temporal)
    emit(args, listed, lambda: render_quotas(listed))
    return 0


async def cmd_token(args: argparse.Namespace) -> int:
    from workers.admin import create_token, render_tokens, revoke_token, tokens

    temporal = (await temporal_client(args)).temporal
    if args.verb == "create":
        if (args.namespace is None) == (not args.admin):
            raise AstraeusError("token create: name the workspace (NAMESPACE), or give --admin")
        if args.namespace is not None:
            try:
                Quota(namespace=args.namespace)  # the same rule as a spec's namespace
            except ValidationError as error:
                raise AstraeusError(f"token create {args.namespace}:\n{format_errors(error)}") from None
        secret, token = await create_token(temporal, args.namespace, args.note or "")
        emit(args, {"token": secret, **token.model_dump(mode="json", exclude={"sha256"})}, lambda: secret)
        return 0
    if args.verb == "revoke":
        if not args.namespace:
            raise AstraeusError("token revoke: name the token's id (astraeus token ls)")
        listed = await revoke_token(temporal, args.namespace)
    else:
        listed = await tokens(temporal)
    shown = [t.model_dump(mode="json", exclude={"sha256"}) for t in listed]
    emit(args, shown, lambda: render_tokens(listed))
    return 0


async def cmd_ca(args: argparse.Namespace) -> int:
    from activities.identity import CA_CERT, ClusterCA

    ca = ClusterCA(ca_dir(args.ca_dir))
    try:
        if args.action == "init":
            made = ca.ensure()
            print(f"{'made' if made else 'kept'} the cluster CA in {ca.directory} (its certificate: "
                  f"{ca.directory / CA_CERT})")  # fmt: skip
            return 0
        if not (ca.directory / CA_CERT).exists():
            raise AstraeusError(f"no cluster CA in {ca.directory}: `astraeus ca init` makes one (so does the control "
                                "plane, when it issues its first identity)")  # fmt: skip
        print(ca.certificate_pem().decode(), end="")
    except OSError as error:
        raise AstraeusError(f"--ca-dir {ca.directory}: {error}") from None
    return 0
