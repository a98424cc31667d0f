"""`cleaner ui`: a read-only local web app over a warehouse (docs/architecture.md §14).

Needs the `ui` extra (Starlette, Jinja2, uvicorn): `pip install 'cleaner[ui]'`.
"""
