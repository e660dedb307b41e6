"""The smallest settings that serve the shop: one app, one SQLite database, no middleware.

``transaction_mode: IMMEDIATE`` (Django >= 5.1) makes ``atomic()`` begin with the write
lock, so workers queue on ``timeout`` instead of failing with "database is locked" when a
deferred transaction that read first tries to write after another worker committed.
"""

from __future__ import annotations

import os

SECRET_KEY = "recipe-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = ["tests.recipes.django_shop"]
MIDDLEWARE: list[str] = []  # a JSON API: no sessions, no CSRF
ROOT_URLCONF = "tests.recipes.django_shop.urls"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["ORDERS_DB"],  # the producer database: the log lives beside orders
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
    }
}
