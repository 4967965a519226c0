from tests.service_fixtures import long_model, service_model

__all__ = ["long_model", "service_model"]
