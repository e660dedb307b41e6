"""Deployment recipes run for real by tests/test_recipes.py: web services that publish
through their own database connection, a sidecar serving the log, a consumer applying
it.  ``flask_app`` (Flask under gunicorn, plain sqlite3), ``django_shop`` (Django's ORM
under gunicorn), ``sqlalchemy_app`` (SQLAlchemy's ORM under gunicorn), ``audit`` (the
consumer they feed); ``harness`` deploys them as docs/guides/services.md says, loads,
kills and checks them for the tests.
"""
