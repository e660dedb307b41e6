"""The WSGI entry point gunicorn loads in each worker."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.recipes.django_shop.settings")
application = get_wsgi_application()
