"""`exo-tui` with no subcommand opens the console; the tui subcommand's options."""

from __future__ import annotations

import argparse

import pytest

from exo_tui import cli
from exo_tui.commands import tui


def test_bare_exo_tui_routes_to_the_console(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(tui, "run", lambda args: seen.append(args) or 0)
    assert cli.main([]) == 0
    assert cli.main(["--readonly", "--peer", "10.0.0.5", "--peer", "10.0.0.6:52417", "--local-nodes", "2"]) == 0
    assert seen[0].command == "tui" and not seen[0].readonly
    args = seen[1]
    assert args.readonly and args.peer == ["10.0.0.5", "10.0.0.6:52417"] and args.local_nodes == 2


def test_tui_options_parse() -> None:
    args = cli.build_parser().parse_args(
        ["tui", "--config", "c.yaml", "--model", "smollm2-135m", "--attach", "http://127.0.0.1:52415", "--theme", "exo-light"]
    )
    assert (args.config, args.model, args.attach, args.theme) == ("c.yaml", "smollm2-135m", "http://127.0.0.1:52415", "exo-light")


def test_bad_config_says_what_is_wrong(tmp_path, capsys) -> None:  # noqa: ANN001
    bad = tmp_path / "config.yaml"
    bad.write_text("ui:\n  colour: red\n")
    assert cli.main(["tui", "--config", str(bad)]) == 2
    assert "colour" in capsys.readouterr().err


def test_negative_local_nodes_is_refused(capsys) -> None:  # noqa: ANN001
    assert cli.main(["tui", "--local-nodes", "-1"]) == 2
    assert "--local-nodes" in capsys.readouterr().err


def test_theme_choice_is_saved_in_the_config(tmp_path) -> None:  # noqa: ANN001
    from exo_tui.config import load_config

    path = tmp_path / "config.yaml"
    path.write_text("# my settings\nui:\n  theme: exo-dark\n")
    config = load_config(path)
    save = tui.theme_saver(config, str(path))
    save("exo-light")
    assert load_config(path).ui.theme == "exo-light"
    assert "# my settings" in path.read_text()


async def test_attach_to_nothing_says_so_and_keeps_running() -> None:
    from exo_tui.api.client import ClusterClient
    from exo_tui.tui.app import ExoApp
    from tests.tui.conftest import wait_until

    client = ClusterClient("http://127.0.0.1:9")
    app = ExoApp(client, on_start=client.start, on_stop=client.stop)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: any("did not start" in n.message for n in app._notifications), timeout=15)
        note = next(n.message for n in app._notifications if "did not start" in n.message)
        assert "127.0.0.1:9" in note
        await pilot.press("question_mark")  # still answers keys
        await pilot.pause()
        assert app.screen is not app.main_screen
