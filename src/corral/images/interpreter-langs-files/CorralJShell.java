// The Java side of Corral's Java kernel (java_kernel.py): JShell, the JDK's
// own REPL engine (the one IJava is built on), run in this JVM.
//
// Protocol, with the kernel process that started it:
//   in  (stdin):           one frame per cell: 'x', the code
//   out (the file named by argv[0], a pipe): 'o' stdout bytes, 'e' stderr
//       bytes, 'r' the last expression's value, 'E' an error (its name, its
//       message and its trace, separated by NUL), 'd' done (also sent once
//       when ready)
// A frame is its kind (one byte), a length (4 bytes, big-endian) and that
// many bytes of UTF-8. The user's System.in is empty and System.out/err
// are captured, so nothing the cell prints can be taken for a frame unless
// it opens the pipe itself (then it only breaks its own kernel).
import java.io.BufferedInputStream;
import java.io.BufferedOutputStream;
import java.io.ByteArrayInputStream;
import java.io.DataInputStream;
import java.io.DataOutputStream;
import java.io.EOFException;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.OutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.stream.Collectors;
import jdk.jshell.Diag;
import jdk.jshell.EvalException;
import jdk.jshell.ExpressionSnippet;
import jdk.jshell.JShell;
import jdk.jshell.JShellException;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;
import jdk.jshell.UnresolvedReferenceException;
import jdk.jshell.VarSnippet;

public final class CorralJShell {
    private static DataOutputStream proto;
    // Set by SIGINT, cleared when a cell starts: a stopped snippet must not
    // be followed by the rest of its cell.
    private static volatile boolean interrupted;
    // A cell is running: an interrupt keeps stopping it until it ends (a
    // stop that lands while a snippet compiles does nothing).
    private static volatile boolean running;

    static synchronized void send(char kind, byte[] data, int off, int len) {
        try {
            proto.writeByte(kind);
            proto.writeInt(len);
            proto.write(data, off, len);
            proto.flush();
        } catch (IOException e) {
            Runtime.getRuntime().halt(3); // the kernel is gone
        }
    }

    static void send(char kind, String text) {
        byte[] b = text.getBytes(StandardCharsets.UTF_8);
        send(kind, b, 0, b.length);
    }

    /** Each write is a frame: what the cell prints streams as it is printed. */
    static final class Chunks extends OutputStream {
        private final char kind;

        Chunks(char kind) {
            this.kind = kind;
        }

        @Override
        public void write(int b) {
            write(new byte[] {(byte) b}, 0, 1);
        }

        @Override
        public void write(byte[] b, int off, int len) {
            if (len > 0) send(kind, b, off, len);
        }
    }

    /**
     * A subclass on purpose: PrintStream itself writes println's text and
     * its line end in one write, a subclass in two, as IJava's stream does
     * (E2B's clients see "Hello" then "\n").
     */
    static final class Out extends PrintStream {
        Out(char kind) {
            super(new Chunks(kind), true, StandardCharsets.UTF_8);
        }
    }

    public static void main(String[] args) throws IOException {
        proto = new DataOutputStream(new BufferedOutputStream(new FileOutputStream(args[0])));
        DataInputStream in = new DataInputStream(new BufferedInputStream(System.in));
        PrintStream out = new Out('o');
        PrintStream err = new Out('e');
        System.setOut(out);
        System.setErr(err);
        System.setIn(new ByteArrayInputStream(new byte[0]));
        // E2B's Java contexts read environment variables as system
        // properties: the kernel's environment (the sandbox's) becomes them,
        // where no property of that name exists.
        for (Map.Entry<String, String> e : System.getenv().entrySet()) {
            if (System.getProperty(e.getKey()) == null) System.setProperty(e.getKey(), e.getValue());
        }
        JShell shell = JShell.builder().executionEngine("local").out(out).err(err).build();
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), s -> {
            if (!running) return; // between cells: nothing to stop
            interrupted = true;
            Thread stopper = new Thread(() -> {
                while (running && interrupted) {
                    shell.stop();
                    try {
                        Thread.sleep(20);
                    } catch (InterruptedException e) {
                        return;
                    }
                }
            }, "corral-stop");
            stopper.setDaemon(true);
            stopper.start();
        });
        send('d', "");
        while (true) {
            byte kind;
            try {
                kind = in.readByte();
            } catch (EOFException e) {
                break;
            }
            byte[] body = new byte[in.readInt()];
            in.readFully(body);
            if (kind == 'x') {
                interrupted = false;
                running = true;
                try {
                    cell(shell, new String(body, StandardCharsets.UTF_8));
                } catch (Throwable e) { // the loop must answer 'd', whatever the cell did
                    error(e.getClass().getName(), String.valueOf(e.getMessage()), trace(e.toString(), e));
                } finally {
                    running = false;
                }
                out.flush();
                err.flush();
            }
            send('d', "");
        }
        Runtime.getRuntime().halt(0);
    }

    /** Runs a cell snippet by snippet; the last one's value is its result. */
    static void cell(JShell shell, String code) {
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String rest = code;
        String value = null;
        while (!rest.isBlank()) {
            SourceCodeAnalysis.CompletionInfo info = analysis.analyzeCompletion(rest);
            String source;
            switch (info.completeness()) {
                case EMPTY:
                    return;
                case COMPLETE:
                case COMPLETE_WITH_SEMI:
                    source = info.source();
                    rest = info.remaining();
                    break;
                default: // incomplete or unknown: eval says what is wrong
                    source = rest;
                    rest = "";
            }
            value = null;
            if (interrupted) {
                error("InterruptedException", "the execution was interrupted", "");
                return;
            }
            for (SnippetEvent ev : shell.eval(source)) {
                if (ev.causeSnippet() != null) continue; // a dependent's update
                if (interrupted) {
                    error("InterruptedException", "the execution was interrupted", "");
                    return;
                }
                if (ev.exception() != null) {
                    exception(ev.exception());
                    return;
                }
                if (ev.status() == Snippet.Status.REJECTED) {
                    rejected(shell, ev.snippet());
                    return;
                }
                if (ev.status() == Snippet.Status.RECOVERABLE_NOT_DEFINED) {
                    unresolved(shell, ev.snippet());
                    return;
                }
                if (shows(ev.snippet()) && ev.value() != null) value = shown(ev.snippet(), ev.value());
            }
        }
        // A null value is no result, as IJava shows none.
        if (value != null && !value.equals("null")) send('r', value);
    }

    /**
     * An expression's value is shown; a declaration's, an assignment's or a
     * statement's is not (as IJava).
     */
    static boolean shows(Snippet s) {
        switch (s.subKind()) {
            case TEMP_VAR_EXPRESSION_SUBKIND:
            case VAR_VALUE_SUBKIND:
            case OTHER_EXPRESSION_SUBKIND:
                return true;
            default:
                return false;
        }
    }

    /**
     * JShell gives a String's value as a Java literal; IJava shows the
     * string itself (its toString), and so does this kernel.
     */
    static String shown(Snippet s, String value) {
        String type = s instanceof VarSnippet ? ((VarSnippet) s).typeName()
                : s instanceof ExpressionSnippet ? ((ExpressionSnippet) s).typeName() : "";
        boolean string = "String".equals(type) || "java.lang.String".equals(type);
        boolean character = "char".equals(type) || "Character".equals(type)
                || "java.lang.Character".equals(type);
        char quote = string ? '"' : '\'';
        if (!(string || character) || value.length() < 2 || value.charAt(0) != quote) return value;
        StringBuilder b = new StringBuilder();
        for (int i = 1; i < value.length() - 1; i++) {
            char c = value.charAt(i);
            if (c != '\\' || i + 1 >= value.length() - 1) {
                b.append(c);
                continue;
            }
            char n = value.charAt(++i);
            switch (n) {
                case 'b': b.append('\b'); break;
                case 't': b.append('\t'); break;
                case 'n': b.append('\n'); break;
                case 'f': b.append('\f'); break;
                case 'r': b.append('\r'); break;
                case 'u':
                    if (i + 4 < value.length()) {
                        b.append((char) Integer.parseInt(value.substring(i + 1, i + 5), 16));
                        i += 4;
                    }
                    break;
                default:
                    if (n >= '0' && n <= '7') { // octal, up to three digits
                        int end = i;
                        while (end < i + 3 && end < value.length() - 1
                                && value.charAt(end) >= '0' && value.charAt(end) <= '7') end++;
                        b.append((char) Integer.parseInt(value.substring(i, end), 8));
                        i = end - 1;
                    } else {
                        b.append(n); // \" \' \\
                    }
            }
        }
        return b.toString();
    }

    static void exception(JShellException x) {
        if (x instanceof EvalException) {
            EvalException e = (EvalException) x;
            String head = e.getExceptionClassName() + (e.getMessage() == null ? "" : ": " + e.getMessage());
            error(e.getExceptionClassName(), String.valueOf(e.getMessage()), trace(head, e));
        } else if (x instanceof UnresolvedReferenceException) {
            String name = ((UnresolvedReferenceException) x).getSnippet().name();
            error("UnresolvedReferenceException", name + " uses what is not defined", "");
        } else {
            error(x.getClass().getSimpleName(), String.valueOf(x.getMessage()), trace(x.toString(), x));
        }
    }

    /** A declaration that names what does not exist: IJava's compile error. */
    static void unresolved(JShell shell, Snippet s) {
        String names = "";
        if (s instanceof jdk.jshell.DeclarationSnippet) {
            names = shell.unresolvedDependencies((jdk.jshell.DeclarationSnippet) s)
                    .collect(Collectors.joining(", "));
        }
        String msg = "cannot find symbol" + (names.isEmpty() ? "" : ": " + names);
        error("CompilationException", msg, "error: " + msg + "\n" + s.source());
    }

    static void rejected(JShell shell, Snippet s) {
        List<Diag> diags = shell.diagnostics(s).collect(Collectors.toList());
        StringBuilder tb = new StringBuilder();
        String first = "";
        for (Diag d : diags) {
            String msg = d.getMessage(Locale.ROOT);
            if (first.isEmpty()) first = msg;
            tb.append(d.isError() ? "error: " : "warning: ").append(msg).append('\n');
            tb.append(excerpt(s.source(), d)).append('\n');
        }
        if (first.isEmpty()) first = "the snippet was rejected";
        error("CompilationException", first, tb.toString());
    }

    /** The line of the source a diagnostic is on, and a caret under it. */
    static String excerpt(String source, Diag d) {
        int pos = (int) Math.max(0, Math.min(d.getPosition(), source.length()));
        int start = source.lastIndexOf('\n', Math.max(0, pos - 1)) + 1;
        int end = source.indexOf('\n', pos);
        if (end < 0) end = source.length();
        return source.substring(start, end) + "\n" + " ".repeat(pos - start) + "^";
    }

    static String trace(String head, Throwable t) {
        StringBuilder b = new StringBuilder(head);
        for (StackTraceElement el : t.getStackTrace()) b.append("\n\tat ").append(el);
        return b.toString();
    }

    static void error(String name, String message, String trace) {
        send('E', name + "\0" + message + "\0" + trace);
    }
}
