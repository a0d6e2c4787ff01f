from __future__ import annotations

from django.db import models


class Order(models.Model):
    number = models.IntegerField(unique=True)

    class Meta:
        app_label = "django_shop"
