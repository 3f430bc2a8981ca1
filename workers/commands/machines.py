"""The verbs of machines and of the drives they hold: nodes (ls, cordon, uncordon, remove, data-location) and drive."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from workers.commands.options import emit, runs_client, temporal_client
from workers.errors import AstraeusError, NotFound
from workers.render import render_nodes
from workflows.domain.drives import NewDrive
from workflows.domain.spec import format_errors


async def cmd_nodes(args: argparse.Namespace) -> int:
    if args.verb != "ls":
        return await cmd_node_verb(args)
    views = await (await runs_client(args)).nodes()
    emit(args, views, lambda: render_nodes(views))
    return 0


async def cmd_node_verb(args: argparse.Namespace) -> int:
    from workers.admin import node_verb

    if not args.name:
        raise AstraeusError(f"nodes {args.verb}: name the machine")
    if args.verb == "data-location":
        return await cmd_data_location(args)
    if args.path is not None:
        raise AstraeusError(f"nodes {args.verb}: takes no PATH")
    view = await node_verb((await temporal_client(args)).temporal, args.name, args.verb, args.reason)
    done = {"cordon": "cordoned", "uncordon": "uncordoned", "remove": "removed"}[args.verb]
    emit(args, view, lambda: f"{done} {args.name}")
    return 0


async def cmd_data_location(args: argparse.Namespace) -> int:
    """`nodes data-location NAME PATH` chooses where the machine keeps copies of drives; without PATH, shows it."""
    from workers.admin import render_data, set_data_location

    client = await temporal_client(args)
    if args.path is None:
        view = next((v for v in await client.nodes() if v.name == args.name), None)
        if view is None:
            raise NotFound(f"no machine named {args.name}")
    else:
        view = await set_data_location(client.temporal, args.name, args.path)
    emit(args, view, lambda: render_data(view))
    return 0


async def cmd_drive(args: argparse.Namespace) -> int:
    from workers.admin import create_drive, drives, remove_drive, render_drives

    temporal = (await temporal_client(args)).temporal
    if args.verb != "ls" and not args.name:
        raise AstraeusError(f"drive {args.verb}: name the drive")
    if args.verb == "create":
        given = {"machine": args.machine, "size_bytes": args.size, "source": args.source}
        missing = [f"--{k.removesuffix('_bytes')}" for k, v in given.items() if v is None]
        given["site"] = args.site
        if missing:
            raise AstraeusError(f"drive create {args.name}: give {', '.join(missing)}")
        try:
            new = NewDrive(name=args.name, **given)
        except ValidationError as error:
            raise AstraeusError(f"drive create {args.name}:\n{format_errors(error)}") from None
        listed = await create_drive(temporal, new)
    elif args.verb == "rm":
        listed = await remove_drive(temporal, args.name)
    else:
        listed = await drives(temporal)
    emit(args, listed, lambda: render_drives(listed))
    return 0
