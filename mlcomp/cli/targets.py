"""``mlcomp targets``: the targets, what each compiles, and whether it can run here.

    $ mlcomp targets
    $ mlcomp targets --json

Registered lazily by :mod:`mlcomp.cli.main`.
"""
from __future__ import annotations

import json

import click

__all__ = ["targets_cmd"]


@click.command("targets")
@click.option("--json", "as_json", is_flag=True,
              help="Print the same facts (name, availability and why not, description, capabilities, the "
                   "target's own spec options) as JSON.")
def targets_cmd(as_json: bool = False) -> None:
    """List the targets, what each compiles (modes, dtypes, devices), their own options
    (``--target "tvm{kernels=off}"``) and whether each can run here."""
    from mlcomp.base.spec_options import options_of
    from mlcomp.targets import TargetName, get_target

    rows = []
    for name in TargetName:
        target = get_target(name)
        reason = target.available()
        rows.append({"name": name.value, "available": reason is None, "reason": reason,
                     "description": target.description, "compiles": target.capabilities.describe(),
                     "capabilities": target.capabilities.to_json(),
                     "options": [{"name": o.name, "type": o.type_text(), "default": o.default, "help": o.help}
                                 for o in options_of(target.Options)]})
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    width = max(len(r["name"]) for r in rows)
    for row in rows:
        state = "available" if row["available"] else f"unavailable: {row['reason']}"
        click.echo(f"{row['name']:<{width}}  {state}")
        click.echo(f"{'':<{width}}  {row['description']}")
        click.echo(f"{'':<{width}}  compiles: {row['compiles']}")
        for opt in row["options"]:
            click.echo(f"{'':<{width}}  option {row['name']}{{{opt['name']}=...}}: {opt['type']}, "
                       f"default {opt['default']}: {opt['help']}")
