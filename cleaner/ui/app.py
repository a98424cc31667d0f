"""The trajectory browser's web app (Starlette, Jinja2 pages rendered on the server).

Design decisions (docs/architecture.md §14):
- Starlette, not FastAPI: the app serves HTML pages, so FastAPI's request validation and OpenAPI
  schema would be dead weight; Starlette is the small ASGI core FastAPI is built on, with Jinja2
  templates and a test client. uvicorn serves it.
- Every page is rendered on the server; the only assets are one stylesheet and the SVG figures,
  both served by the app itself: the pages load nothing from the network and run no script.
- Reads go through one `Browser` snapshot (cleaner.warehouse.browse), locked down: each read takes
  a cursor of its own from a small pool, so pages are served side by side; the SQL box runs on a
  database of its own (`Browser.sql`), one query at a time, so no page ever waits for it, and a
  second query while one runs is refused at once (429) instead of queueing.
- Errors a reader can cause are pages, never tracebacks: an unknown rollout or config is a 404,
  a refused query is said above the query box, a snapshot whose parts a compaction removed is a
  409 saying to refresh (the warehouse moved or deleted: 410), a refresh that cannot take a new
  snapshot says why and keeps the old one (never a 500), anything unexpected is a 500 page naming
  the error type (its traceback goes to the log only).
- The SQL box's page holds at most SQL_MAX_ROWS rows, SQL_MAX_CHARS characters of cells and
  SQL_CELL_CHARS of one cell (said so); the CSV at most CSV_MAX_ROWS rows and CSV_MAX_CHARS
  (its X-Cleaner-Cut header says where it was cut).
- Every response carries a Content-Security-Policy (nothing but the app's own stylesheet and
  images; an SVG figure may style itself), X-Frame-Options DENY, Referrer-Policy no-referrer and
  X-Content-Type-Options nosniff (`Guard`, around everything, the 500 page included). A POST whose
  Origin is another site, or that the browser marks cross-site (Sec-Fetch-Site), is refused (403),
  so a page elsewhere cannot make the app refresh; a client that sends neither (curl) is served.
  The refresh form says where to return (`next`, a path of this app): no referrer is sent.
- With a token (required off loopback, `server.check_host`), every request must carry it: as
  `?token=` (which also sets a cookie, so links need not repeat it), the cookie, or an
  `X-Cleaner-Token` / `Authorization: Bearer` header; otherwise 401. On loopback without a token,
  only loopback Host headers are served, so a web page elsewhere cannot read the app through a
  DNS name it re-points to 127.0.0.1.
"""

from __future__ import annotations

import csv
import hmac
import io
import logging
import threading
from pathlib import Path
from urllib.parse import parse_qs, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from cleaner.errors import CleanerError
from cleaner.report.inspection import Decoder, load_decoder, load_inspection
from cleaner.report.tables import csv_cell
from cleaner.ui.overview import Overview
from cleaner.ui.rollout_view import purified_pane, raw_segments
from cleaner.warehouse.browse import CLASSES, Browser, RolloutFilter, SnapshotStale, WarehouseGone
from cleaner.warehouse.readonly import QueryBusy, QueryRefused

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
TOKEN_COOKIE = "cleaner_ui_token"
PAGE_SIZE = 50
SQL_MAX_ROWS = 1000  # rows shown under the query box
SQL_MAX_CHARS = 2_000_000  # characters of cells shown under the query box
SQL_CELL_CHARS = 2_000  # characters of one cell shown there
CSV_MAX_ROWS = 1_000_000  # rows of a CSV download
CSV_MAX_CHARS = 100_000_000  # characters of cells of a CSV download
MAX_OFFSET = 2**62  # the rollout list's largest offset (DuckDB's OFFSET is a 64-bit integer)
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1", "[::1]"]

TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                               autoescape=True, undefined=jinja2.StrictUndefined)


class State:
    """What the handlers share: the snapshot, its overview, the tokenizers loaded so far."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        self.overview: Overview | None = None
        self.decoders: dict[str | None, Decoder] = {}
        self._overview_lock = threading.Lock()  # the overview is computed once per snapshot

    def get_overview(self) -> Overview:
        with self._overview_lock:
            if self.overview is None:
                with self.browser.cursor() as connection:
                    self.overview = Overview(connection)
            return self.overview

    def refresh(self) -> None:
        self.browser.refresh()
        with self._overview_lock:
            self.overview = None

    def decoder(self, model: str | None) -> Decoder:
        if model not in self.decoders:
            self.decoders[model] = load_decoder(model)
        return self.decoders[model]


def page(request: Request, template: str, status_code: int = 200, **context) -> HTMLResponse:
    state: State = request.app.state.ui
    body = TEMPLATES.get_template(template).render(
        request=request, warehouse=str(state.browser.root), path=request.url.path,
        findings=state.browser.findings, **context)
    return HTMLResponse(body, status_code=status_code)


# ----------------------------------------------------------------------------------------------
# Pages


def overview_page(request: Request) -> Response:
    overview = request.app.state.ui.get_overview()
    return page(request, "overview.html", overview=overview, data=overview.data)


def chart(request: Request) -> Response:
    svg = request.app.state.ui.get_overview().svg(request.path_params["name"])
    if svg is None:
        raise HTTPException(404, f"no figure {request.path_params['name']!r} in this warehouse")
    return Response(svg, media_type="image/svg+xml", headers={"Cache-Control": "no-cache"})


def _filter(request: Request) -> RolloutFilter:
    params = request.query_params

    def value(name: str, kind=str):
        text = params.get(name, "").strip()
        if not text:
            return None
        try:
            return kind(text)
        except ValueError as error:
            raise HTTPException(400, f"{name} must be a {kind.__name__}, got {text!r}") from error

    try:
        return RolloutFilter(iteration=value("iteration", int), group_id=value("group"),
                             reward_min=value("reward_min", float), reward_max=value("reward_max", float),
                             finish_reason=value("finish_reason"), error_type=value("error_type"),
                             premise_class=value("class"), collect_view=value("collect_view"))
    except ValueError as error:
        raise HTTPException(400, str(error)) from error


def rollouts_page(request: Request) -> Response:
    state: State = request.app.state.ui
    where = _filter(request)
    try:
        offset = max(0, int(request.query_params.get("offset", "0")))
    except ValueError as error:
        raise HTTPException(400, "offset must be an integer") from error
    if offset > MAX_OFFSET:  # DuckDB's OFFSET is a 64-bit integer
        raise HTTPException(400, f"offset must be at most {MAX_OFFSET}, got {offset}")
    listing = state.browser.list_rollouts(where, offset, PAGE_SIZE)
    kept = {k: v for k, v in request.query_params.items() if k not in ("offset", "token") and v}

    def at(new_offset: int) -> str:
        return "/rollouts?" + urlencode({**kept, "offset": new_offset})

    previous = at(max(0, offset - PAGE_SIZE)) if offset > 0 else None
    following = at(offset + PAGE_SIZE) if offset + PAGE_SIZE < listing.total else None
    return page(request, "rollouts.html", listing=listing, facets=state.browser.facets(), classes=CLASSES,
                selected=kept, previous=previous, following=following)


def rollout_page(request: Request) -> Response:
    state: State = request.app.state.ui
    rollout_id = request.path_params["rollout_id"]
    inspection = load_inspection(state.browser, rollout_id)
    if inspection is None:
        raise HTTPException(404, f"no rollout {rollout_id!r} in this warehouse")
    decoder = state.decoder(inspection.model)
    rows = inspection.rows
    wanted = request.query_params.get("config")
    chosen = [pair for pair in rows if wanted is None or pair[0].config_id == wanted][:1]
    if wanted is not None and not chosen:
        raise HTTPException(404, f"rollout {rollout_id!r} has no purified row under config {wanted!r}")
    pane = purified_pane(inspection.segments, *chosen[0], decoder.decode) if chosen else None
    wanted_id = pane.row.config_id if pane is not None else None
    raw = raw_segments(inspection.segments, pane.explained if pane else (), decoder.decode)
    rollout = inspection.rollout
    group = state.browser.group(rollout.group_id, rollout.iteration) if rollout is not None else ()
    return page(request, "rollout.html", inspection=inspection, rollout=rollout, raw=raw, pane=pane,
                configs=[_config_label(row, config) for row, config in rows], note=decoder.note,
                listed=state.browser.listed(rollout_id), group=group,
                negatives=next((c.n_negatives for c in inspection.configs if c.config_id == wanted_id), 0))


def _config_label(row, config) -> tuple[str, str]:
    """(config_id, a label of its parameters) for the selector."""
    if config is None:
        return row.config_id, f"{row.config_id} (config row missing)"
    return row.config_id, (f"{row.config_id}: γ={config.gamma:g} p={config.rollback_prob:g} "
                           f"on {config.similarity_on}, {config.purify_when}")


def sql_page(request: Request) -> Response:
    state: State = request.app.state.ui
    query = request.query_params.get("q", "")
    result, error, status = None, None, 200
    if query.strip():
        try:
            result = state.browser.sql.run(query, SQL_MAX_ROWS, SQL_MAX_CHARS, SQL_CELL_CHARS)
        except QueryRefused as refused:
            error, status = str(refused), _status(refused)
    csv_link = "/sql.csv?" + urlencode({"q": query}) if result is not None else None
    return page(request, "sql.html", query=query, result=result, error=error, csv_link=csv_link,
                status_code=status, csv_rows=CSV_MAX_ROWS, csv_chars=CSV_MAX_CHARS)


def _status(refused: QueryRefused) -> int:
    return 429 if isinstance(refused, QueryBusy) else 400


def sql_csv(request: Request) -> Response:
    state: State = request.app.state.ui
    try:
        result = state.browser.sql.run(request.query_params.get("q", ""), CSV_MAX_ROWS, CSV_MAX_CHARS)
    except QueryRefused as refused:
        return Response(f"error: {refused}\n", status_code=_status(refused), media_type="text/plain")
    sink = io.StringIO()
    writer = csv.writer(sink)
    writer.writerow(result.columns)
    writer.writerows([csv_cell(value) for value in row] for row in result.rows)
    headers = {"Content-Disposition": 'attachment; filename="query.csv"'}
    if result.cut is not None:
        headers["X-Cleaner-Cut"] = result.cut
    return Response(sink.getvalue(), media_type="text/csv", headers=headers)


async def refresh(request: Request) -> Response:
    """A new snapshot, then back to the page the form was on (its `next`: a path of this app)."""
    try:
        request.app.state.ui.refresh()
    except CleanerError as error:
        status = _expected_status(error)
        return page(request, "error.html", status_code=status, status=status,
                    message=f"{error} (the pages read the previous snapshot until a refresh succeeds)")
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    back = form.get("next", ["/"])[0]
    local = back.startswith("/") and not back.startswith(("//", "/\\"))  # never another site
    return RedirectResponse(back if local else "/", status_code=303)


# ----------------------------------------------------------------------------------------------
# Errors and the token


async def http_error(request: Request, error: HTTPException) -> Response:
    return page(request, "error.html", status_code=error.status_code, status=error.status_code,
                message=error.detail)


def _expected_status(error: CleanerError) -> int:
    """410: the warehouse is gone; 409: it changed beneath the snapshot; else 500."""
    if isinstance(error, WarehouseGone):
        return 410
    return 409 if isinstance(error, SnapshotStale) else 500


async def expected_error(request: Request, error: CleanerError) -> Response:
    status = _expected_status(error)
    return page(request, "error.html", status_code=status, status=status, message=str(error))


async def unexpected_error(request: Request, error: Exception) -> Response:
    logger.exception("%s %s failed", request.method, request.url.path)
    return page(request, "error.html", status_code=500, status=500,
                message=f"{type(error).__name__} (a bug: the traceback is in the server's log)")


class TokenGate(BaseHTTPMiddleware):
    """Refuses (401) any request that does not carry the token (module docstring)."""

    def __init__(self, app, token: str) -> None:
        super().__init__(app)
        self.token = token.encode()

    async def dispatch(self, request: Request, call_next) -> Response:
        in_query = request.query_params.get("token")
        bearer = request.headers.get("authorization", "")
        given = (in_query or request.headers.get("x-cleaner-token")
                 or (bearer[7:] if bearer.lower().startswith("bearer ") else None)
                 or request.cookies.get(TOKEN_COOKIE) or "")
        if not hmac.compare_digest(given.encode(), self.token):
            return HTMLResponse("<!doctype html><title>401</title><h1>401: a token is required</h1>"
                                "<p>Open the address <code>cleaner ui</code> printed (it carries "
                                "<code>?token=</code>).</p>", status_code=401)
        response = await call_next(request)
        if in_query:
            response.set_cookie(TOKEN_COOKIE, in_query, httponly=True, samesite="strict")
        return response


# ----------------------------------------------------------------------------------------------
# Security headers and the Origin check


PAGE_POLICY = ("default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
               "frame-ancestors 'none'; base-uri 'none'")
SVG_POLICY = "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'"  # matplotlib's inline styles
SECURITY_HEADERS = {"X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"}
SAME_SITE = ("same-origin", "none")  # Sec-Fetch-Site values of a request this app's own page (or the user) made


def cross_site(headers: Headers, scheme: str) -> bool:
    """Whether the browser says another site sent the request (module docstring)."""
    fetched_from = headers.get("sec-fetch-site")
    if fetched_from is not None and fetched_from not in SAME_SITE:
        return True
    origin = headers.get("origin")
    return origin is not None and origin != f"{scheme}://{headers.get('host', '')}"


class Guard:
    """ASGI: the security headers on every response, a cross-site POST refused (403)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                svg = headers.get("content-type", "").startswith("image/svg+xml")
                headers["Content-Security-Policy"] = SVG_POLICY if svg else PAGE_POLICY
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
            await send(message)

        if scope["method"] == "POST" and cross_site(Headers(scope=scope), scope.get("scheme", "http")):
            refused = PlainTextResponse("403: a cross-site request; use the page's own button\n", status_code=403)
            await refused(scope, receive, with_headers)
            return
        await self.app(scope, receive, with_headers)


class _App(Starlette):
    """Starlette with `Guard` outside everything, its 500 page included."""

    def build_middleware_stack(self):
        return Guard(super().build_middleware_stack())


def create_app(browser: Browser, token: str | None = None, loopback: bool = True) -> Starlette:
    """The app over one browser snapshot; `token` is required on every request when given."""
    middleware = []
    if loopback and token is None:
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=LOOPBACK_HOSTS))
    if token is not None:
        middleware.append(Middleware(TokenGate, token=token))
    routes = [
        Route("/", overview_page),
        Route("/charts/{name}.svg", chart),
        Route("/rollouts", rollouts_page),
        Route("/rollouts/{rollout_id:path}", rollout_page),
        Route("/sql", sql_page),
        Route("/sql.csv", sql_csv),
        Route("/refresh", refresh, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = _App(routes=routes, middleware=middleware, exception_handlers={
        HTTPException: http_error, CleanerError: expected_error, Exception: unexpected_error})
    app.state.ui = State(browser)
    return app
