"""`labkit completion bash|zsh`: a shell completion script, written from the command line's own parser so that it
names every command and option there is and no other.

    eval "$(labkit completion bash)"     # in ~/.bashrc
    eval "$(labkit completion zsh)"      # in ~/.zshrc (zsh reads the bash script through its bashcompinit)

The script completes commands, subcommands, options and the values of options with fixed choices; anything else
(a spec, a log, a run directory) falls back to the shell's file names. It is plain `case` statements, which bash and
zsh's bash emulation read alike.
"""
from __future__ import annotations

import argparse
import shlex

SHELLS = ("bash", "zsh")


def register(sub) -> None:
    p = sub.add_parser("completion", help="print a shell completion script (eval \"$(labkit completion bash)\")")
    p.add_argument("shell", choices=SHELLS)
    p.set_defaults(func=_completion)


def commands(parser: argparse.ArgumentParser, path: str = "") -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """Each command path ("" for labkit itself, "/logs/parse" for `labkit logs parse`) -> (the words that may follow
    it: subcommands and a positional argument's choices first, then options; the choices of each option that has
    them)."""
    names, options, choices, out = [], [], {}, {}
    for action in parser._actions:  # argparse keeps no public list of a parser's arguments
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                names.append(name)
                out.update(commands(subparser, f"{path}/{name}"))
        elif not action.option_strings:
            names += [str(c) for c in action.choices or ()]
        else:
            options += action.option_strings
            if action.choices:
                choices.update({option: [str(c) for c in action.choices] for option in action.option_strings})
    return {path: (names + options, choices), **out}


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for `parser`'s program in `shell` (bash, or zsh through bashcompinit)."""
    table = commands(parser)
    prog = parser.prog
    func = "_" + prog.replace("-", "_")
    paths = "|".join(shlex.quote(p) for p in table if p)
    choice_cases = "".join(f"        {shlex.quote(f'{path} {option}')}) words={shlex.quote(' '.join(values))} ;;\n"
                           for path, (_, choices) in table.items() for option, values in choices.items())
    word_cases = "".join(f"        {shlex.quote(path)}) words={shlex.quote(' '.join(words))} ;;\n"
                         for path, (words, _) in table.items())
    body = f"""{func}() {{
    local cur prev path word words i
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    path=""
    i=1
    while [ "$i" -lt "$COMP_CWORD" ]; do  # the (sub)commands typed so far
        word="${{COMP_WORDS[i]}}"
        case "$path/$word" in
        {paths}) path="$path/$word" ;;
        esac
        i=$((i + 1))
    done
    words=""
    case "$path $prev" in  # an option's fixed choices
{choice_cases}    esac
    if [ -z "$words" ]; then
        case "$path" in
{word_cases}        esac
        case "$cur" in  # after a command with no subcommands, options only when asked for; else file names
        -*) ;;
        *) case "$words" in -*) words="" ;; esac ;;
        esac
    fi
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
}}
complete -o default -F {func} {prog}
"""
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + body
    return body


def _completion(args) -> int:
    from labkit.cli import build_parser

    print(script(build_parser(), args.shell), end="")
    return 0

