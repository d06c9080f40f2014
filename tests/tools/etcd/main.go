// Command etcd is the etcd server, built from its Go module at the version that
// k8s.io/kubernetes itself pins (see ../go.mod), so the tests need no prebuilt etcd.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
