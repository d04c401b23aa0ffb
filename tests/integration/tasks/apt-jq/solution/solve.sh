#!/bin/bash
jq -r .name /app/pkg.json > /app/name.txt
