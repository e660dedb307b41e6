"""Recipe: a Django project writing orders through its ORM and publishing them in the same
``transaction.atomic()`` block, served by gunicorn.

    ORDERS_DB=shop.db DJANGO_SETTINGS_MODULE=tests.recipes.django_shop.settings \\
        python -m django migrate --run-syncdb
    python -m streamq serve shop.db --port 7400      # the sidecar, as in the Flask recipe
    ORDERS_DB=shop.db gunicorn --workers 3 --bind 127.0.0.1:8000 tests.recipes.django_shop.wsgi
"""
