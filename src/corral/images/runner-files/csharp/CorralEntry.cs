// The entry point of a C# call under Mono. SandboxFusion runs C# with
// `dotnet run` (a Debug build): a failed Debug.Assert prints "Assertion
// failed" and ends the process. Mono's default listener only logs, so this
// listener makes a failed assertion end the call the same way, then the
// call's own Main runs.
using System;
using System.Diagnostics;
using System.Linq;
using System.Reflection;

class CorralAssertListener : TraceListener {
    public override void Write(string m) { Console.Error.Write(m); }
    public override void WriteLine(string m) { Console.Error.WriteLine(m); }
    public override void Fail(string message, string detail) {
        Console.Error.WriteLine("Process terminated. Assertion failed.");
        if (!string.IsNullOrEmpty(message)) Console.Error.WriteLine(message);
        if (!string.IsNullOrEmpty(detail)) Console.Error.WriteLine(detail);
        Console.Error.WriteLine(Environment.StackTrace);
        Console.Error.Flush();
        Environment.Exit(134);
    }
}

static class CorralEntry {
    static int Main(string[] args) {
        Trace.Listeners.Clear();
        Trace.Listeners.Add(new CorralAssertListener());
        var main = Assembly.GetExecutingAssembly().GetTypes()
            .Where(t => t != typeof(CorralEntry))
            .SelectMany(t => t.GetMethods(BindingFlags.Static | BindingFlags.Public | BindingFlags.NonPublic))
            .FirstOrDefault(m => m.Name == "Main");
        if (main == null) { Console.Error.WriteLine("error: no static Main method"); return 1; }
        object[] call = main.GetParameters().Length == 0 ? new object[0] : new object[] { args };
        try {
            object r = main.Invoke(null, call);
            return r is int ? (int)r : 0;
        } catch (TargetInvocationException e) {
            Console.Error.WriteLine("Unhandled exception. " + e.InnerException);
            Console.Error.Flush();
            return 1;
        }
    }
}
