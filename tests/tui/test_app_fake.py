"""Keys in, state out: the console over the in-test FakeCluster."""

from __future__ import annotations

import dataclasses

from textual.widgets import Input

from exo_tui import events as ev
from exo_tui.tui.screens.detail import NodeDetailScreen
from exo_tui.tui.screens.dialogs import ConfirmChange, HelpScreen, Prompt, Question
from exo_tui.tui.screens.hosts import HostsScreen
from exo_tui.tui.widgets.chat import Answer, ChatPane, keep_line_breaks
from exo_tui.tui.widgets.cluster import PartitionBar
from exo_tui.tui.widgets.events import EventsLog
from exo_tui.tui.widgets.nodes import NodesTable
from tests.tui.conftest import plain, wait_until


def table(app) -> NodesTable:  # noqa: ANN001
    return app.main_screen.query_one(NodesTable)


def partition_text(app) -> str:  # noqa: ANN001
    bar = app.main_screen.query_one(PartitionBar)
    return "\n".join(line.plain for line in bar._lines(100))


async def test_dashboard_lists_nodes_keyed_by_id(make_app, fake):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        t = table(app)
        assert [k.value for k in t.rows] == ["n01", "n00", "n02"]  # sorted by name
        assert t.get_cell("n00", "name").plain == "mac-studio"
        assert t.get_cell("n00", "layers").plain == "0–9"
        assert "nodes 3/3 ready" in plain(app.main_screen.query_one("#header"))


async def test_cursor_survives_refresh_and_changes_are_marked(make_app, fake):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("down", "down")
        assert table(app).selected_node_id == "n02"
        # a new node appears (rows re-laid out) and another node's layers change
        fake.nodes["n09"] = dataclasses.replace(fake.nodes["n00"], node_id="n09", name="aaa-first")
        fake.nodes["n01"] = dataclasses.replace(fake.nodes["n01"], layers=(10, 12))
        app.refresh_now()
        await pilot.pause()
        t = table(app)
        assert t.row_count == 4
        assert t.selected_node_id == "n02"
        assert ("n01", "layers") in t._changed
        assert t.get_cell("n01", "layers").style  # highlighted
        app.refresh_now()
        app.refresh_now()
        assert ("n01", "layers") not in table(app)._changed  # the mark fades after two refreshes


async def test_a_value_wider_than_its_column_widens_it_and_others_keep_the_layout(make_app, fake):
    """Cells update in place every second; the columns are measured again (a layout of the whole
    screen) only when a value outgrows its column."""
    from textual.widgets.data_table import ColumnKey

    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        t = table(app)
        width = t.columns[ColumnKey("tok_s")].content_width
        measured = []
        real = t._update_column_widths
        t._update_column_widths = lambda *a, **kw: measured.append(1) or real(*a, **kw)
        fake.nodes["n00"] = dataclasses.replace(fake.nodes["n00"], cpu_percent=fake.nodes["n00"].cpu_percent + 1)
        app.refresh_now()
        await pilot.pause()
        assert measured == []  # a value of the same width: no new measure
        fake.nodes["n00"] = dataclasses.replace(fake.nodes["n00"], tok_per_s=123456.7)
        app.refresh_now()
        await pilot.pause()
        text = t.get_cell("n00", "tok_s").plain
        assert len(text) > width and t.columns[ColumnKey("tok_s")].content_width >= len(text)


async def test_drain_opens_confirmation_defaulting_to_cancel(make_app, fake):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("down")  # mac-studio (n00)
        await pilot.press("D")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange))
        confirm = app.screen
        assert confirm.preview.action == "drain" and confirm.preview.targets == ("n00",)
        assert app.focused.id == "cancel"
        text = plain(confirm.query_one("#diff"))
        assert "mac-studio" in text and "→" in text and "tok/s" in text
        await pilot.press("enter")  # Cancel
        await wait_until(pilot, lambda: not isinstance(app.screen, ConfirmChange))
        assert fake.applied == []
        assert fake.nodes["n00"].layers == (0, 10)

        await pilot.press("D")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange))
        await pilot.press("y")
        await wait_until(pilot, lambda: fake.applied and table(app).get_cell("n00", "layers").plain == "—")
        assert fake.nodes["n00"].drained
        bar = partition_text(app)
        assert "mac-studio" not in bar.splitlines()[2]  # the bar's labels no longer show it
        assert "plan v2" in bar


async def test_the_partition_view_shows_each_shards_bytes(make_app, fake):
    """Each node's part of the plan with its bytes (the file's, quantized), and what the plan
    counts it needs with its KV caches against what the node offers."""
    fake.layer_bytes = 25_000_000
    fake.shards = fake._split(fake._eligible())
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: "MB" in partition_text(app))
        legend = partition_text(app)
        assert "mac-studio 0–9 (10) 250.0 MB (275.0 MB with KV, of 500.0 MB)" in legend, legend


async def test_unpin_command_takes_off_a_pin_by_id(make_app, fake):
    """:unpin ID reaches a pinned node the table cannot show (not in the cluster now: its pin is
    kept with the cluster's state); :unpin alone asks which node."""
    fake.pins["n-gone"] = (0, 10)
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("colon", *"unpin", "enter")
        await pilot.pause()
        assert any("Which node?" in n.message for n in app._notifications)
        await pilot.press("colon", *"unpin n-gone", "enter")  # moves nothing: no confirmation, as with p
        await wait_until(pilot, lambda: bool(fake.applied))
        assert [(a.action, a.targets) for a in fake.applied] == [("unpin", ("n-gone",))]
        assert "n-gone" not in fake.pins


async def test_marked_nodes_are_the_targets(make_app, fake):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("space", "space")  # marks linux-box and mac-studio, cursor moves down
        assert table(app).marked == {"n01", "n00"}
        assert table(app).get_cell("n01", "mark").plain == "✓"
        await pilot.press("D")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange))
        assert set(app.screen.preview.targets) == {"n00", "n01"}
        await pilot.press("y")
        await wait_until(pilot, lambda: len(fake.applied) == 1 and not table(app).marked)
        assert fake.nodes["n00"].drained and fake.nodes["n01"].drained


async def test_pin_survives_rebalance(make_app, fake):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("down", "down")  # old-laptop n02, layers 20-29
        await pilot.press("p")  # pin applies straight after its preview
        await wait_until(pilot, lambda: fake.pins.get("n02") == (20, 30))
        await wait_until(pilot, lambda: "⚑" in table(app).get_cell("n02", "layers").plain)
        await pilot.press("R")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange))
        await pilot.press("y")
        await wait_until(pilot, lambda: len(fake.applied) == 2)
        assert fake.nodes["n02"].layers == (20, 30)
        assert "⚑pinned" in partition_text(app)


async def test_pin_a_range_of_layers_asks_then_confirms_the_move(make_app, fake):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("down", "down")  # old-laptop n02, layers 20-29
        await pilot.press("P")
        await wait_until(pilot, lambda: isinstance(app.screen, Prompt))
        assert app.screen.query_one(Input).value == "20-29"  # the node's layers to edit
        app.screen.query_one(Input).value = "9-3"
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert not isinstance(app.screen, ConfirmChange) and fake.applied == []  # a bad range changes nothing
        await pilot.press("P")
        await wait_until(pilot, lambda: isinstance(app.screen, Prompt))
        app.screen.query_one(Input).value = "0-9"
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange))  # layers move: confirm first
        await pilot.press("y")
        await wait_until(pilot, lambda: len(fake.applied) == 1)
        assert fake.applied[0].layers == (0, 10) and fake.pins["n02"] == (0, 10)
        await wait_until(pilot, lambda: fake.nodes["n02"].layers == (0, 10))


async def test_readonly_hides_dangerous_keys(make_app, fake):
    app = make_app(readonly=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("D", "R", "p")
        await pilot.pause(0.1)
        assert not isinstance(app.screen, ConfirmChange)
        assert fake.applied == [] and fake.pins == {}
        footer_keys = {b.binding.action for b in app.screen.active_bindings.values() if b.enabled}
        assert not {"drain", "undrain", "pin", "rebalance"} & footer_keys
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert not any("Drain" in t or t == ":rebalance" for t in titles)
        assert "READONLY" in plain(app.main_screen.query_one("#header"))


async def test_chat_streams_markdown_with_status(make_app, fake):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.main_screen.query_one(ChatPane)
        await pilot.click("#chat-input")
        await pilot.press(*"capital?")
        await pilot.press("enter")
        await wait_until(pilot, lambda: chat.query(Answer) and not chat.streaming)
        answer = chat.query_one(Answer)
        assert "**Paris**" in answer.text
        assert answer.finished and answer.body.content.markup == keep_line_breaks(answer.text)
        status = plain(answer.status)
        assert "completion" in status and "31.5 tok/s" in status and "mac-studio" in status
        assert chat.messages[-1] == {"role": "assistant", "content": answer.text}
        # up-arrow brings the prompt back
        await pilot.press("up")
        assert chat.prompt_input.value == "capital?"


async def test_a_long_answer_streams_as_one_text_and_ends_as_markdown(make_app, fake):
    """An answer is one widget, however long: nothing is mounted per line while it streams (a part
    per ``PART_LINES`` lines, so a redraw wraps no more than that) nor after (Textual's Markdown
    made a widget of every list item, and laying them all out again as answers grew slowed a
    512-token answer, and the coordinator beside it, to 15 tok/s)."""
    fake.reply = "Capitals:\n\n" + "".join(f"{i}. City {i}, Country {i}\n" for i in range(1, 121))
    fake.chat_delay_s = 0.002
    fake.hold_before = "61."  # mid-answer, however slow the machine: it goes on when the test has looked
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.main_screen.query_one(ChatPane)
        await chat.send("list them")

        def streamed(answer: Answer) -> str:
            return "\n".join([*(plain(w) for w in answer.query(".answer-part")), plain(answer.body)])

        await wait_until(pilot, lambda: chat.query(Answer) and "City 60," in streamed(chat.query_one(Answer)))
        answer = chat.query_one(Answer)
        assert chat.streaming and not answer.finished
        parts = [plain(w) for w in answer.query(".answer-part")]
        page = min(Answer.PART_LINES, chat.log_view.size.height - 3)  # the page and the status line fit
        assert 1 <= len(parts) <= 60 // page  # 60 and some lines have come
        assert all(p.count("\n") >= page for p in parts)
        assert plain(answer.body).count("\n") <= page  # a redraw wraps no more than a page
        room = answer.body.styles.min_height.value  # the body grows a few lines at a time
        assert plain(answer.body).count("\n") < room <= page + 1
        assert room == page + 1 or room % Answer.STEP_LINES == 0
        shown = streamed(answer)
        assert shown.startswith("Capitals:") and answer.text.startswith(shown)
        fake.resume.set()
        await wait_until(pilot, lambda: not chat.streaming)
        assert answer.text == fake.reply
        assert answer.finished and answer.body.content.markup == keep_line_breaks(answer.text)
        assert len(list(answer.walk_children())) == 2  # its body and its status line
        await pilot.pause()
        shown = "\n".join(line.text for line in answer.body.render_lines(answer.body.region.reset_offset))
        assert "City 120, Country 120" in shown and answer.body.region.height >= 122


async def test_a_finished_answer_keeps_its_line_breaks(make_app, fake):
    """Markdown joins a paragraph's lines; a model's lines (a poem, an address) are meant as
    lines: they stay lines once the answer is rendered as Markdown, and code stays as it came."""
    fake.reply = ("A haiku:\nwaves fold into foam\nthe shore keeps what the sea says\nsalt on the cold wind\n\n"
                  "```\nx = 1\ny = 2\n```\n- one\n- two")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.main_screen.query_one(ChatPane)
        await chat.send("a haiku")
        await wait_until(pilot, lambda: chat.query(Answer) and not chat.streaming)
        answer = chat.query_one(Answer)
        assert answer.finished and answer.text == fake.reply
        await pilot.pause()
        shown = [line.text.strip() for line in answer.body.render_lines(answer.body.region.reset_offset)]
        for line in ("A haiku:", "waves fold into foam", "the shore keeps what the sea says", "salt on the cold wind",
                     "x = 1", "y = 2"):
            assert line in shown, (line, shown)
        assert "• one" in shown and "• two" in shown


async def test_escape_stops_and_keeps_partial_answer_and_keys_work_meanwhile(make_app, fake):
    fake.chat_delay_s = 0.2
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.main_screen.query_one(ChatPane)
        await chat.send("tell me")
        await wait_until(pilot, lambda: chat.query(Answer) and len(chat.query_one(Answer).text) > 10)
        # the UI stays live while the answer streams: drain opens its confirmation
        table(app).focus()
        await pilot.press("D")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmChange))
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, ConfirmChange))
        assert chat.streaming
        chat.prompt_input.focus()
        await pilot.press("escape")
        await wait_until(pilot, lambda: not chat.streaming)
        answer = chat.query_one(Answer)
        assert 0 < len(answer.text) < len(fake_reply())
        assert "stopped" in plain(answer.status)
        assert chat.messages[-1]["content"] == answer.text


def fake_reply() -> str:
    from tests.tui.fake_cluster import REPLY

    return REPLY


async def test_chat_error_restores_prompt(make_app, fake):
    fake.fail_next_chat = "no plan: every node is drained; undrain one (U)"
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.main_screen.query_one(ChatPane)
        await chat.send("hello there")
        await wait_until(pilot, lambda: not chat.streaming)
        assert chat.prompt_input.value == "hello there"
        assert not chat.query(Answer)
        assert any("undrain one" in n.message for n in app._notifications)
        assert chat.messages == []


async def test_command_mode_and_theme_saved(make_app, fake):
    saved: list[str] = []
    app = make_app(on_theme_change=saved.append)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        assert app.theme == "exo-dark"
        await pilot.press("colon")
        assert app.focused.id == "command"
        await pilot.press(*"theme exo-light", "enter")
        await pilot.pause()
        assert app.theme == "exo-light" and saved == ["exo-light"]
        await pilot.press("t")
        assert app.theme == "exo-dark" and saved[-1] == "exo-dark"
        await pilot.press("colon", *"hosts", "enter")
        await wait_until(pilot, lambda: isinstance(app.screen, HostsScreen))
        await pilot.press("q")
        await wait_until(pilot, lambda: app.screen is app.main_screen)
        await pilot.press("colon", *"nope", "enter")
        await pilot.pause()
        assert any("Unknown command :nope" in n.message for n in app._notifications)


async def test_set_changes_the_chats_sampling(make_app, fake):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        chat = app.main_screen.query_one(ChatPane)
        await pilot.press("colon", *"set temperature 0", "enter")
        await pilot.press("colon", *"set max_tokens=64", "enter")
        await pilot.pause()
        assert (chat.params.temperature, chat.params.max_tokens) == (0.0, 64)
        assert any("temperature 0 · " in n.message and "max_tokens 64" in n.message for n in app._notifications)
        await pilot.press("colon", *"set temperature hot", "enter")
        await pilot.press("colon", *"set warmth 1", "enter")
        await pilot.pause()
        assert chat.params.temperature == 0.0  # refused, unchanged
        errors = [n.message for n in app._notifications if n.severity == "error"]
        assert any("temperature takes a number, not 'hot'" in e for e in errors)
        assert any("no setting 'warmth'" in e and "temperature, top_p" in e for e in errors)
        await chat.send("hello")
        await wait_until(pilot, lambda: not chat.streaming)
        assert fake.chat_params[-1].temperature == 0.0 and fake.chat_params[-1].max_tokens == 64
        # Typed in the chat itself, a known command runs; anything else starting with ':' is a message.
        chat.prompt_input.focus()
        asked = len(fake.chats)
        await pilot.press(*":set top_k 40", "enter")
        await pilot.pause()
        assert chat.params.top_k == 40 and len(fake.chats) == asked and chat.prompt_input.value == ""
        await pilot.press(*":) thanks", "enter")
        await wait_until(pilot, lambda: len(fake.chats) == asked + 1 and not chat.streaming)
        assert fake.chats[-1][-1]["content"] == ":) thanks"


async def test_help_is_for_the_focused_pane(make_app):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        assert app.screen.scope == "nodes"
        text = plain(app.screen.query_one("#help-body"))
        assert "Drain" in text and ":hosts" in text
        await pilot.press("escape")
        app.main_screen.query_one(EventsLog).focus()
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        assert app.screen.scope == "events"


async def test_node_detail_shows_score_breakdown(make_app):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("down", "enter")
        await wait_until(pilot, lambda: isinstance(app.screen, NodeDetailScreen))
        screen = app.screen
        assert screen.node_id == "n00"
        score = plain(screen.query_one("#detail-score"))
        assert "vram_fit" in score and "performance" in score and "112.5" in score
        assert "layers 0–9" in plain(screen.query_one("#detail-shards"))
        assert "experts" not in plain(screen.query_one("#detail-shards"))  # a dense model
        await pilot.press("q")
        await wait_until(pilot, lambda: app.screen is app.main_screen)


async def test_node_detail_shows_a_mixtures_experts_per_layer(make_app, fake):
    fake.experts = (128, 8)
    fake.shards = fake._split(fake._eligible())  # the plan it serves, of a mixture now
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("down", "enter")
        await wait_until(pilot, lambda: isinstance(app.screen, NodeDetailScreen))
        await wait_until(pilot, lambda: "128 experts a layer, 8 chosen a token" in plain(app.screen.query_one("#detail-shards")))


async def test_what_a_node_runs_its_shard_at_shows_in_the_partition_and_its_detail(make_app, fake):
    fake.precision = "int8"  # an ONNX node on a K-quant file, its default (auto)
    fake.shards = fake._split(fake._eligible())
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await wait_until(pilot, lambda: " int8" in partition_text(app))
        await pilot.press("down", "enter")
        await wait_until(pilot, lambda: isinstance(app.screen, NodeDetailScreen))
        await wait_until(pilot, lambda: "runs at int8" in plain(app.screen.query_one("#detail-shards")))


async def test_bootstrap_asks_for_the_host_key_then_shows_steps(make_app, fake):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("b")
        await wait_until(pilot, lambda: isinstance(app.screen, HostsScreen))
        await pilot.press("b")
        await wait_until(pilot, lambda: isinstance(app.screen, Question))
        assert app.focused.id == "no"
        assert "SHA256:" in plain(app.screen.query_one("#question-body"))
        await pilot.press("y")
        await wait_until(pilot, lambda: "install" in app.bootstrap_steps.get("10.0.0.20", {}))
        await wait_until(pilot, lambda: isinstance(app.screen, HostsScreen))
        progress = plain(app.screen.query_one("#bootstrap-progress"))
        assert "✓ connect" in progress and "install" in progress and "pending" in progress


async def test_pause_freezes_the_view(make_app, fake):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("Z")
        fake.nodes["n00"] = dataclasses.replace(fake.nodes["n00"], name="renamed")
        fake.events.publish(ev.Notice(level="info", message="while paused"))
        app.refresh_now()
        await pilot.pause(0.05)
        assert table(app).get_cell("n00", "name").plain == "mac-studio"
        assert "PAUSED" in plain(app.main_screen.query_one("#header"))
        await pilot.press("Z")
        await pilot.pause(0.05)
        assert table(app).get_cell("n00", "name").plain == "renamed"
        assert any("while paused" in e.message for e, _ in app.main_screen.query_one(EventsLog)._logged if isinstance(e, ev.Notice))


async def test_events_name_a_node_that_just_joined(make_app, fake):
    """A node's first events (loading its shard) come before a snapshot lists it: the log names it
    from its join event, not by its id."""
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        fake.events.publish(ev.NodeJoined(node_id="n-7f3a", name="new-box", address="10.0.0.9", port=52416))
        fake.events.publish(ev.NodeStateChanged(node_id="n-7f3a", state="loading", reason="layers 0-9"))
        log_view = app.main_screen.query_one(EventsLog)
        await wait_until(pilot, lambda: any(isinstance(e, ev.NodeStateChanged) for e, _ in log_view._logged))
        text = "\n".join(line.text for line in log_view.lines)
        assert "new-box is loading: layers 0-9" in text and "n-7f3a" not in text


async def test_filter_narrows_the_table(make_app):
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("slash", *"mac")
        assert table(app).row_count == 1
        await pilot.press("escape")
        assert table(app).row_count == 3
        assert not app.main_screen.query_one("#filter", Input).display


async def test_keys_typed_right_after_colon_reach_the_command_line(make_app):
    """A fast typist (or tmux send-keys) sends ':chat' in one go: nothing may leak to the table."""
    from textual import events

    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        for key, char in [("colon", ":"), ("c", "c"), ("h", "h"), ("a", "a"), ("t", "t"), ("enter", None)]:
            event = events.Key(key, char)
            event.set_sender(app)
            app._driver.send_message(event)
        await wait_until(pilot, lambda: app.focused is not None and app.focused.id == "chat-input")
        assert app.screen is app.main_screen  # 'a' did not open the add-host prompt
        assert app.main_screen.maximized is app.main_screen.query_one(ChatPane)  # short terminal: chat alone
        await pilot.press("colon")  # in the chat input a ':' is text
        assert app.focused.id == "chat-input" and app.focused.value == ":"


async def test_c_moves_to_the_chat_and_the_question_typed_after_it_lands_there(make_app):
    """The console starts on the nodes table, where letters are commands; the chat box says how to
    get to it, and ``c`` then a question typed in one go (tmux send-keys, a fast typist) asks it:
    the ``a`` of "a cat" must not open the add-host prompt."""
    from textual import events

    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        chat = app.main_screen.query_one(ChatPane)
        assert app.focused is table(app)
        assert "press c to chat" in chat.prompt_input.placeholder
        for char in "cWhat is a cat":
            event = events.Key("space" if char == " " else char, char)
            event.set_sender(app)
            app._driver.send_message(event)
        await wait_until(pilot, lambda: chat.prompt_input.value == "What is a cat")
        assert app.screen is app.main_screen and app.focused is chat.prompt_input
        assert chat.prompt_input.placeholder.startswith("Ask the cluster")
        await pilot.press("escape")  # nothing streaming: back to the table, and the hint is back
        await wait_until(pilot, lambda: app.focused is table(app))
        assert "press c to chat" in chat.prompt_input.placeholder


async def test_a_chat_waiting_for_memory_says_so_and_the_header_counts_the_queue(make_app, fake):
    from exo_tui.cluster.view import QueueView

    fake.queue = QueueView(running=8, queued=3, admitted=40, preempted=1, rejected=2, queue_bound=64)
    fake.queued_ahead = [2, 1]
    fake.admit.clear()
    app = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await wait_until(pilot, lambda: "3 queued" in plain(app.main_screen.query_one("#header")))
        assert "8 running · 3 queued · 1 preempted · 2 refused" in plain(app.main_screen.query_one("#header"))
        chat = app.main_screen.query_one(ChatPane)
        await pilot.click("#chat-input")
        await pilot.press(*"capital?")
        await pilot.press("enter")
        await wait_until(pilot, lambda: chat.query(Answer) and "queued (1 ahead)" in plain(chat.query_one(Answer).status))
        fake.admit.set()
        await wait_until(pilot, lambda: not chat.streaming)
        assert "**Paris**" in chat.query_one(Answer).text and "tok/s" in plain(chat.query_one(Answer).status)


async def test_the_coordinators_pane_shows_a_sets_roles_term_and_lag(make_app, fake):
    from exo_tui.cluster.view import CoordinatorView
    from exo_tui.tui.widgets.coordinators import CoordinatorsPane

    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        pane = app.main_screen.query_one(CoordinatorsPane)
        assert not pane.display  # a single coordinator: no pane
        fake.coordinators = (
            CoordinatorView("10.0.0.1:52418", "mac-studio", "http://10.0.0.1:52415", "leader", 7, 0),
            CoordinatorView("10.0.0.2:52418", "nuc", "http://10.0.0.2:52415", "standby", 7, 3),
            CoordinatorView("10.0.0.3:52418", "pi", "http://10.0.0.3:52415", "unreachable", 7, -1),
        )
        fake.version += 1  # a change the console refreshes for
        fake.events.publish(ev.Notice(level="info", message="coordinator mac-studio leads in term 7"))
        await wait_until(pilot, lambda: pane.display)
        text = plain(pane)
        assert "term 7" in text and "★ mac-studio leader" in text and "● nuc standby lag 3" in text
        assert "✖ pi unreachable" in text


async def test_node_detail_shows_the_measured_layer_time_beside_the_start_up_one(make_app, fake):
    fake.nodes["n00"] = dataclasses.replace(fake.nodes["n00"], layer_s_startup=0.00021, layer_s_measured=0.00084)
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: table(app).row_count == 3)
        await pilot.press("down", "enter")
        await wait_until(pilot, lambda: isinstance(app.screen, NodeDetailScreen))
        await wait_until(pilot, lambda: "840 µs measured · 210 µs start-up" in plain(app.screen.query_one("#detail-summary")))
