"""Single tool call: the model must look the weather up and report it.

The task names the city it asks about in `expected_city`. Reward 1.0 when
the model called get_weather for that city and its final answer states the
temperature the tool returned; 0.0 otherwise. The forecast is a pure
function of the city name, so rollouts are reproducible.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated

from pydantic import Field

from gym_grpc.resources import ResourcesServer, Session, Verification, tool
from gym_grpc.responses import final_text, function_calls, function_outputs
from gym_grpc.v1 import responses_pb2 as r

CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]


def forecast(city: str) -> dict:
    """The weather of a city: the same city always gets the same weather."""
    digest = hashlib.sha256(city.strip().lower().encode()).digest()
    return {"city": city, "temperature_c": digest[0] % 45 - 10, "conditions": CONDITIONS[digest[1] % len(CONDITIONS)]}


class WeatherEnv(ResourcesServer):
    @tool
    async def get_weather(
        self, city: Annotated[str, Field(description="Name of the city, for example 'Paris'.")]
    ) -> str:
        """Get the current weather in a city."""
        if not city.strip():
            raise ValueError("city must not be empty")
        return json.dumps(forecast(city))

    async def verify(self, session: Session, response: r.Response) -> Verification:
        expected = str(session.data.get("expected_city", "")).strip().lower()
        outputs = function_outputs(response)
        calls = [c for c in function_calls(response) if c.name == "get_weather"]
        right_calls = []
        for call in calls:
            try:
                city = json.loads(call.arguments).get("city", "")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(city, str) and city.strip().lower() == expected and call.call_id in outputs:
                right_calls.append(call)
        reported = False
        if right_calls:
            temperature = json.loads(outputs[right_calls[-1].call_id])["temperature_c"]
            reported = re.search(rf"(?<![\d-]){temperature}(?!\d)", final_text(response)) is not None
        return Verification(
            reward=1.0 if right_calls and reported else 0.0,
            fields={"tool_calls": len(calls), "right_city": bool(right_calls), "reported_temperature": reported},
        )
