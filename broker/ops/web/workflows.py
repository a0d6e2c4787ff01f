"""The dashboard's workflow page: a workflow's graph, drawn on the server as SVG (no
script, no library), and a table of its members with their parents and states.

A job page links here when its job belongs to a workflow (the one read of the workflow
is made when the page is first loaded, not at each refresh of its live part). The
graph places each member in the column of its depth (one more than its deepest parent)
and draws an arrow from each parent to its child; a box's colour is its member's
status, as the status badges of the other pages. A workflow larger than
:data:`DRAWN_MEMBERS` is shown as the table alone: a fan-in of a thousand members
would be a column taller than any screen.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from broker.ops.web.pages import _e, _status, _table, _td
from broker.wire import messages as protocol

if TYPE_CHECKING:
    from broker.ops.web.dashboard import Dashboard

DRAWN_MEMBERS = 200
"""Members up to which the graph is drawn (beyond it, the table alone)."""

_BOX_W, _BOX_H, _GAP_X, _GAP_Y = 180, 34, 70, 14
_FILL = {
    "waiting": "#eceff3",
    "queued": "#fbeed0",
    "handed_off": "#d9e6fb",
    "completed": "#d4f0da",
    "failed": "#f8d4d4",
    "cancelled": "#dddddd",
}


def depths(view: protocol.WorkflowView) -> dict[uuid.UUID, int]:
    """Each member's column: 0 without a parent in the workflow, else one more than its
    deepest parent's (members come parents first, so one pass is enough)."""
    shown = {m.job_id for m in view.members}
    parents: dict[uuid.UUID, list[uuid.UUID]] = {}
    for edge in view.edges:
        if edge.parent in shown:
            parents.setdefault(edge.child, []).append(edge.parent)
    depth: dict[uuid.UUID, int] = {}
    for member in view.members:
        depth[member.job_id] = 1 + max(
            (depth.get(p, 0) for p in parents.get(member.job_id, [])), default=-1
        )
    return depth


def graph_svg(view: protocol.WorkflowView) -> str:
    """The workflow as an SVG: a box per member (a link to its job page, its task and
    status inside), an arrow per edge from parent to child."""
    depth = depths(view)
    rows: dict[int, int] = {}
    where: dict[uuid.UUID, tuple[int, int]] = {}
    for member in view.members:
        column = depth[member.job_id]
        row = rows.get(column, 0)
        rows[column] = row + 1
        where[member.job_id] = (column * (_BOX_W + _GAP_X), row * (_BOX_H + _GAP_Y))
    width = (max(depth.values(), default=0) + 1) * (_BOX_W + _GAP_X)
    height = max(rows.values(), default=1) * (_BOX_H + _GAP_Y)
    lines = []
    for edge in view.edges:
        if edge.parent not in where or edge.child not in where:
            continue
        (px, py), (cx, cy) = where[edge.parent], where[edge.child]
        lines.append(
            f'<line class="edge" x1="{px + _BOX_W}" y1="{py + _BOX_H // 2}" '
            f'x2="{cx - 4}" y2="{cy + _BOX_H // 2}" stroke="#8a93a0" '
            'marker-end="url(#arrow)"/>'
        )
    boxes = []
    for member in view.members:
        x, y = where[member.job_id]
        status = member.status.value
        boxes.append(
            f'<a href="/jobs/{member.job_id}"><g class="node {_e(status)}" '
            f'data-job="{member.job_id}">'
            f'<rect x="{x}" y="{y}" width="{_BOX_W}" height="{_BOX_H}" rx="4" '
            f'fill="{_FILL.get(status, "#fff")}" stroke="#8a93a0"/>'
            f'<text x="{x + 6}" y="{y + 14}" font-size="12">{_e(member.task[-26:])}</text>'
            f'<text x="{x + 6}" y="{y + 28}" font-size="11" fill="#4a5260">'
            f"{_e(status)} · {str(member.job_id)[:8]}</text></g></a>"
        )
    return (
        f'<svg id="graph" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="-2 -2 {width + 4} {height + 4}">'
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" '
        'markerHeight="6" orient="auto"><path d="M0,0L10,5L0,10z" fill="#8a93a0"/></marker>'
        f"</defs>{''.join(lines)}{''.join(boxes)}</svg>"
    )


def workflow_live(view: protocol.WorkflowView) -> str:
    """The workflow page's live part: its status, the graph, and a table of members with
    their parents (links to their job pages)."""
    rows = []
    for member in view.members:
        parents = " ".join(
            f'<a href="/jobs/{p}">{_e(str(p)[:8])}</a>' for p in view.parents(member.job_id)
        )
        rows.append(
            [
                f'<td><a href="/jobs/{member.job_id}">{_e(str(member.job_id)[:8])}</a></td>',
                _td(member.task),
                f"<td>{_status(member.status.value)}</td>",
                _td(member.attempts, numeric=True),
                f"<td>{parents or '-'}</td>",
                _td(member.error or ""),
            ]
        )
    drawn = (
        graph_svg(view)
        if len(view.members) <= DRAWN_MEMBERS
        else f'<p class="muted">{len(view.members)} members: too many to draw, listed below.</p>'
    )
    cut = (
        '<p class="muted">More members or edges exist than a view carries; the first '
        "ones are shown.</p>"
        if view.truncated
        else ""
    )
    return (
        f'<p id="workflow-status">{_e(view.workflow_id)} {_status(view.status)} '
        f"{len(view.members)} jobs</p>"
        f'<div class="graph">{drawn}</div>{cut}'
        + _table(["job", "task", "status", "failed runs", "parents", "error"], rows, "no members")
    )


def workflow_link(view: protocol.WorkflowView | None) -> str:
    """What a job page shows above its live part when its job is in a workflow."""
    if view is None:
        return ""
    return (
        f'<p id="workflow-link">In workflow <a href="/workflows/{view.workflow_id}">'
        f"{_e(view.workflow_id)}</a> ({_e(view.status)}, {len(view.members)} jobs)</p>"
    )


async def read(dashboard: Dashboard, any_id: uuid.UUID) -> protocol.WorkflowView | None:
    """The workflow of ``any_id`` (its id, or one of its jobs'), through the dashboard's
    own request slots; ``None`` for none, or a store that cannot read workflows."""
    try:
        info = await dashboard._ask(protocol.GetWorkflow(request_id="web", workflow_id=any_id))
    except Exception:  # a store without SupportsWorkflows: the job page shows no link
        return None
    return info.workflow if isinstance(info, protocol.WorkflowInfo) else None


async def page(dashboard: Dashboard, request: web.Request) -> web.Response:
    """``GET /workflows/{workflow_id}``."""
    try:
        workflow_id = uuid.UUID(request.match_info["workflow_id"])
    except ValueError:
        raise web.HTTPNotFound(text="not a workflow id") from None
    view = await read(dashboard, workflow_id)
    if view is None:
        raise web.HTTPNotFound(text=f"no workflow {workflow_id}")
    title = f"Workflow {str(view.workflow_id)[:8]}"
    return dashboard._page(request, title, workflow_live(view))
