#!/bin/bash
python3 -c "import json; l=open('/app/log.txt').read().splitlines(); json.dump({'lines': len(l), 'errors': sum(x.startswith('ERROR') for x in l)}, open('/app/report.json','w'))"
