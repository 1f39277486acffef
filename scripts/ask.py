"""Stream one chat answer from an OpenAI-compatible server with the official client."""

import argparse

from openai import OpenAI

p = argparse.ArgumentParser()
p.add_argument("prompt")
p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
p.add_argument("--model", default="smollm2-135m")
args = p.parse_args()
client = OpenAI(base_url=args.base_url, api_key="none")
print(f"> {args.prompt}")
stream = client.chat.completions.create(
    model=args.model, messages=[{"role": "user", "content": args.prompt}], max_tokens=120, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt tokens, {chunk.usage.completion_tokens} generated]")
