#!/bin/bash
printf "Hello, world!\n" > /app/hello.txt
