"""`omnid completion bash|zsh`: a shell completion script made from the command line's own
parser (so a new command or option completes without editing a second list), and
`omnid __complete units`: the unit names of the running stack, asked of the daemon
quietly (nothing printed and exit 0 when none answers), which the script calls when
a command takes unit names (omnid(8), COMPLETION)."""

from __future__ import annotations

import argparse
import sys

# What the value of an option completes to, by the option's dest: directories, files.
_DIRS = {"units", "state_dir", "cgroup_root", "directory"}
_FILES = {"log_file", "control", "python"}
_SIGNALS = ("SIGTERM", "SIGINT", "SIGKILL", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGSTOP")
_UNIT_ARGS = {"unit_names", "unit"}  # positional arguments that are unit names


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            # The hidden ones (help=SUPPRESS, such as __complete) are not offered.
            shown = {ca.dest for ca in action._choices_actions}
            return {name: sp for name, sp in action.choices.items() if name in shown}
    return {}


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions if a.help is not argparse.SUPPRESS for o in a.option_strings]


def _value_kind(action: argparse.Action) -> str:
    """What a value of this option completes to: a word list, 'dir', 'file' or '' (free text)."""
    if action.choices:
        return " ".join(map(str, action.choices))
    if action.dest in _DIRS:
        return "dir"
    if action.dest in _FILES:
        return "file"
    if action.dest == "signal":
        return " ".join(_SIGNALS)
    return ""


def model(parser: argparse.ArgumentParser) -> dict:
    """Commands, their options, which option takes what value, what positionals complete to."""
    cmds = {}
    values: dict[str, str] = {}
    for a in parser._actions:  # the global options (--control)
        if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._SubParsersAction):
            for o in a.option_strings:
                values[o] = _value_kind(a)
    for name, sp in _subcommands(parser).items():
        positional = ""
        for a in sp._actions:
            if a.option_strings:
                if a.nargs != 0 and a.help is not argparse.SUPPRESS:
                    for o in a.option_strings:
                        values[o] = _value_kind(a)
            elif positional:
                continue  # the first positional completes (`omnid example` -> vllm); DIR is typed
            elif a.dest in _UNIT_ARGS:
                positional = "units"
            elif a.choices:
                positional = " ".join(map(str, a.choices))
            elif a.dest in _DIRS:
                positional = "dir"
        cmds[name] = {"options": _options(sp), "positional": positional}
    return {"commands": cmds, "values": values, "global": _options(parser)}


def bash_script(parser: argparse.ArgumentParser) -> str:
    m = model(parser)

    def reply(kind: str) -> str:
        if kind == "dir":
            return 'COMPREPLY=($(compgen -d -- "$cur"))'
        if kind == "file":
            return 'COMPREPLY=($(compgen -f -- "$cur"))'
        if kind == "units":
            return '_omnid_words "$(_omnid_units)"'
        if kind:
            return f'_omnid_words "{kind}"'
        return "COMPREPLY=()"

    by_kind: dict[str, list[str]] = {}
    for opt, kind in m["values"].items():
        by_kind.setdefault(kind, []).append(opt)
    value_cases = "\n".join(f"        {'|'.join(sorted(opts))}) {reply(kind)}; return;;"
                            for kind, opts in by_kind.items())
    opt_cases = "\n".join(f"        {name}) opts=\"{' '.join(c['options'])}\";;" for name, c in m["commands"].items())
    pos_cases = "\n".join(f"        {name}) {reply(c['positional'])};;" for name, c in m["commands"].items()
                          if c["positional"])
    commands = " ".join(m["commands"])
    glob = " ".join(m["global"])
    return f"""# bash completion for omnid: source <(omnid completion bash), or save it as
# /usr/share/bash-completion/completions/omnid. Unit names come from the running daemon
# (omnid __complete units, which prints nothing when none answers).
# zsh runs these through bashcompinit: arrays from 0 and words split as in bash.
_omnid_words() {{  # COMPREPLY = the words of $1 that begin with $cur (zsh's compgen -W does not filter)
    [ -n "${{ZSH_VERSION-}}" ] && setopt localoptions ksharrays shwordsplit
    local w
    COMPREPLY=()
    for w in $1; do
        [[ $w == "$cur"* ]] && COMPREPLY+=("$w")
    done
    return 0
}}

_omnid_units() {{
    [ -n "${{ZSH_VERSION-}}" ] && setopt localoptions ksharrays shwordsplit
    local ctl=() i
    for ((i = 1; i < COMP_CWORD; i++)); do
        case ${{COMP_WORDS[i]}} in
            --control) ctl=(--control "${{COMP_WORDS[i+1]}}");;
            --control=*) ctl=("${{COMP_WORDS[i]}}");;
        esac
    done
    "${{COMP_WORDS[0]}}" "${{ctl[@]}}" __complete units 2>/dev/null
}}

_omnid() {{
    [ -n "${{ZSH_VERSION-}}" ] && setopt localoptions ksharrays shwordsplit
    local cur=${{COMP_WORDS[COMP_CWORD]}} prev=${{COMP_WORDS[COMP_CWORD-1]}} cmd="" opts="" i
    for ((i = 1; i < COMP_CWORD; i++)); do
        case ${{COMP_WORDS[i]}} in
            --control) ((i++));;
            -*) ;;
            *) cmd=${{COMP_WORDS[i]}}; break;;
        esac
    done
    case $prev in
{value_cases}
    esac
    if [[ -z $cmd ]]; then
        _omnid_words "{commands} {glob}"
        return
    fi
    case $cmd in
{opt_cases}
    esac
    if [[ $cur == -* ]]; then
        _omnid_words "$opts"
        return
    fi
    case $cmd in
{pos_cases}
    esac
}}
complete -F _omnid omnid
"""


def zsh_script(parser: argparse.ArgumentParser) -> str:
    """zsh runs the bash function through bashcompinit (shipped with zsh): one logic, two shells."""
    return ("#compdef omnid\n# zsh completion for omnid: source <(omnid completion zsh) after compinit.\n"
            "autoload -U +X bashcompinit && bashcompinit\n" + bash_script(parser))


def print_units(control: str) -> int:
    """`omnid __complete units`: instance and template names of the running stack, one a line.
    Quiet: a shell is waiting, so a short deadline, and nothing at all when nothing answers."""
    import os

    if not os.path.exists(control):  # no daemon: answer before importing the client (asyncio, zmq)
        return 0
    from omnid.cli.client import CliError, Client

    try:
        units = Client(control).call("status", {}, timeout=2)["units"]
    except (CliError, OSError, KeyError, TypeError):
        return 0
    names: list[str] = []
    for u in units:
        names.append(u["name"])
        if "@" in u["name"]:
            names.append(u["name"].split("@", 1)[0])  # a template names every instance
    sys.stdout.write("".join(f"{n}\n" for n in dict.fromkeys(names)))
    return 0

