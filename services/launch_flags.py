"""One command line for the whole stack (`tokenline serve MODEL [flags]`): each flag goes
to the services that take it.

The routing is built from the services' own argparse parsers, so a flag added to a service
is taken here at once, listed in ``--help`` under that service and checked by its parser.
Not routed: the launcher's own flags (the model, the bind address, the ports, TLS) and the
ones it sets itself to wire the services together (each service's ``--port``, the peers'
addresses). A flag several services take (``--log-level``, ``--context-length``) goes to
each of them. A flag no service takes, or a value a service's parser refuses, stops the
launch before anything starts, naming the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.flags_doc import documented_actions

# Where a parse keeps the routed flags: (services, [option string, values...]) in order.
_ROUTED = "routed_flags"


class _Route(argparse.Action):
    """A service flag as the user typed it (option string and raw values), kept for the
    services that take it; their own parsers convert and check it."""

    def __init__(
        self, option_strings: list[str], dest: str, services: tuple[str, ...], **kwargs: Any
    ) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, **kwargs)  # no attribute of its own
        self.services = services

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values is None:
            typed: list[str] = []
        else:
            typed = [values] if isinstance(values, str) else list(values)
        routed = [*getattr(namespace, _ROUTED, []), (self.services, [option_string, *typed])]
        setattr(namespace, _ROUTED, routed)


@dataclass(frozen=True, slots=True)
class _Flag:
    """One service flag and every service that takes it."""

    action: argparse.Action
    services: tuple[str, ...]


def _flags(
    parsers: Mapping[str, argparse.ArgumentParser], skip: Mapping[str, frozenset[str]]
) -> list[_Flag]:
    """The routable flags in the services' order; ValueError if two services spell one
    option differently (a flag and a switch), which no single command line could route."""
    found: dict[tuple[str, ...], _Flag] = {}
    for name, parser in parsers.items():
        for action in documented_actions(parser):
            if skip[name] & set(action.option_strings):
                continue
            key = tuple(action.option_strings)
            seen = found.get(key)
            if seen is not None and seen.action.nargs != action.nargs:
                raise ValueError(f"{key[0]} takes different values in {seen.services + (name,)}")
            services = (seen.services if seen else ()) + (name,)
            found[key] = _Flag(seen.action if seen else action, services)
    options = [o for key in found for o in key]
    clash = sorted({o for o in options if options.count(o) > 1})
    if clash:
        raise ValueError(f"{clash} are spelled differently by different services")
    return list(found.values())


def _metavar(action: argparse.Action) -> str | tuple[str, ...]:
    """What the service's own --help shows for the value."""
    if action.metavar is not None:
        return action.metavar
    if action.choices:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper()


def _group_title(services: tuple[str, ...]) -> str:
    names = list(services)
    joined = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"{joined} flags"


def add_service_flags(
    launcher: argparse.ArgumentParser,
    parsers: Mapping[str, argparse.ArgumentParser],
    wired: Mapping[str, frozenset[str]],
) -> None:
    """Give ``launcher`` every flag of ``parsers`` (service name → its parser) but those
    ``wired`` names per service and the launcher's own, one titled group per set of
    services that take them."""
    own = frozenset(o for a in launcher._actions for o in a.option_strings)
    skip = {name: own | wired.get(name, frozenset()) for name in parsers}
    groups: dict[tuple[str, ...], argparse._ArgumentGroup] = {}
    for flag in _flags(parsers, skip):
        group = groups.get(flag.services)
        if group is None:
            group = groups[flag.services] = launcher.add_argument_group(_group_title(flag.services))
        action = flag.action
        group.add_argument(
            *action.option_strings,
            action=_Route,
            services=flag.services,
            nargs=action.nargs,
            metavar=_metavar(action),
            default=action.default,  # only for the help's %(default)s
            help=action.help,
        )


def route(args: argparse.Namespace, services: Sequence[str]) -> dict[str, list[str]]:
    """Each service's routed flags, in the order they were given."""
    out: dict[str, list[str]] = {name: [] for name in services}
    for takers, typed in getattr(args, _ROUTED, []):
        for name in takers:
            out[name] += typed
    return out


def check(parsers: Mapping[str, argparse.ArgumentParser], flags: Mapping[str, list[str]]) -> None:
    """Each service's parser on its routed flags: a value it refuses exits here (status 2,
    the flag named in its usage line) before any process starts."""
    for name, parser in parsers.items():
        parser.parse_args(flags.get(name, []))
